"""Run one command; print its wall time and peak RSS as JSON. Used by bench.py.

    python -S -I benchmarks/run_measured.py COMMAND [ARG...]

The peak RSS is the child's own ``ru_maxrss`` from ``os.wait4``. It must be measured from a
small launcher like this one: Linux carries the parent's high-water RSS into a child across
``exec`` (Python's subprocess uses vfork, which shares the parent's memory), so measured from a
benchmark process holding hundreds of MiB every child would report at least that much. Forked
from this launcher, a child starts from the launcher's few MiB (bench.py reports that floor).
``RUSAGE_CHILDREN`` is no alternative: it is the maximum over all children so far.

The child's stdout goes to /dev/null; its stderr is this process's stderr. Prints
``{"wall_s": ..., "max_rss_bytes": ..., "exit_code": ...}``, and exits 1 if the child failed.
"""

import json
import os
import sys
import time


def main(command: list[str]) -> None:
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.execvp(command[0], command)
        finally:
            os._exit(127)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - start
    result = {
        "wall_s": wall,
        "max_rss_bytes": usage.ru_maxrss * 1024,  # Linux reports KiB
        "exit_code": os.waitstatus_to_exitcode(status),
    }
    print(json.dumps(result))
    sys.exit(1 if result["exit_code"] else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
