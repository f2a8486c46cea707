"""Peak extra memory of ONE no-grad forward, in this (fresh) process; used by bench.py.

    python benchmarks/memory_probe.py ours|peer SHAPE DTYPE    # e.g. ours 131072,128 float32

Builds the inputs, runs the contender once on them as a warm-up (so one-time costs such as
the thread pool and lazy imports are not counted), returns freed memory to the OS
(``malloc_trim``), resets the peak (writing 5 to /proc/self/clear_refs resets VmHWM), records
VmRSS, runs the forward once and reads VmHWM. Prints JSON: ``extra_bytes`` = VmHWM - VmRSS
before, and ``output_bytes``. Linux only.
"""

from __future__ import annotations

import ctypes
import gc
import json
import re
import sys

import torch
from workloads import CONTENDERS, THREADS, Case, make_inputs


def status_bytes(field: str) -> int:
    """A ``VmXXX`` field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1)) * 1024


def reset_peak() -> None:
    """Give freed heap memory back to the OS, then make VmHWM equal to the current VmRSS."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def measure(contender_name: str, case: Case) -> dict[str, int]:
    """Extra peak bytes of one forward of ``contender_name`` on ``case``, and the output's bytes."""
    torch.set_num_threads(THREADS)
    contender = CONTENDERS[contender_name]
    inputs = make_inputs(case)
    with torch.no_grad():
        contender(inputs)  # warm-up: same shape; the result is freed at once
        reset_peak()
        before = status_bytes("VmRSS")
        out = contender(inputs)
        peak = status_bytes("VmHWM")
    return {"extra_bytes": peak - before, "output_bytes": out.numel() * out.element_size()}


def main(argv: list[str]) -> None:
    contender_name, shape, dtype = argv
    case = Case(tuple(int(size) for size in shape.split(",")), dtype)
    print(json.dumps(measure(contender_name, case)))


if __name__ == "__main__":
    main(sys.argv[1:])
