"""``python -m maskln_cli.op.native``: build the native kernels into the cache (or find them).

Exit status 0 when they load, 1 with the reason on stderr when they cannot be built here.
"""

from __future__ import annotations

import sys
import time

from maskln_cli.op import native


def main() -> int:
    start = time.perf_counter()
    try:
        path = native.build()
    except native.NativeUnavailable as error:
        print(f"maskln native kernels unavailable: {error}", file=sys.stderr)
        return 1
    print(f"{path} ({native.load().isa()}, {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
