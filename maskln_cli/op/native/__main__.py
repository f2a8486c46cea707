"""``python -m maskln_cli.op.native``: build the native kernels into the cache (or find them).

Exit status 0 when they load, 1 with the reason on stderr when they cannot be built here. A
cached build that is damaged (it does not match its build record) is rebuilt.

``--clean`` removes this checkout's build from the cache instead (``make clean``): its folder,
keyed by these sources, this torch and this compiler; other builds stay.
"""

from __future__ import annotations

import argparse
import sys
import time

from maskln_cli.op import native


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m maskln_cli.op.native",
        description="Build maskln's native CPU kernels into the per-user cache (or find them).",
    )
    parser.add_argument(
        "--clean", action="store_true", help="remove this checkout's build from the cache"
    )
    arguments = parser.parse_args(argv)
    if arguments.clean:
        return clean()
    start = time.perf_counter()
    try:
        path = native.build()
    except native.NativeUnavailable as error:
        print(f"maskln native kernels unavailable: {error}", file=sys.stderr)
        return 1
    print(f"{path} ({native.load().isa()}, {time.perf_counter() - start:.1f} s)")
    return 0


def clean() -> int:
    try:
        removed = native.remove_build()
    except native.NativeUnavailable as error:
        print(f"maskln native kernels: nothing removed: {error}", file=sys.stderr)
        return 1
    if removed is None:
        print("maskln native kernels: no build of this checkout in the cache")
    else:
        print(f"maskln native kernels: removed {removed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
