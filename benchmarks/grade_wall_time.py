"""Wall time of ``maskln grade`` as a user runs it: the real entry point, a fresh process each
repetition (so every run pays Python's and torch's start-up, in both processes).

    .venv/bin/python benchmarks/grade_wall_time.py                # 3 repetitions each
    .venv/bin/python benchmarks/grade_wall_time.py --repeat 5 --timeout 5

Four targets:

- two correct solutions, every clause, strict included (the ones bench.py's figure 12 times):
  ``maskln grade maskln_cli:masked_layer_normalization --strict`` and ``maskln grade
  tests/solutions/correct.py --strict`` (target: under 20 s on 2 cores);
- the shipped example with one mistake, ``examples/first_attempt.py``;
- a function that never returns, ``tests/solutions/misbehaving.py:hangs``, with ``--timeout``
  (default 5): two clauses time out (each: the timeout, SIGTERM, a new child), then the grader
  stops running the function and reports. Expect about 2 x (timeout + 1 s grace) + start-ups.

Prints min, median and max wall seconds per target, and how many cores other processes kept
busy meanwhile (well above 0: the machine was shared, rerun before drawing conclusions).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import GRADE_CORRECT, background_load, cpu_snapshot

ROOT = Path(__file__).resolve().parent.parent
MASKLN = [sys.executable, "-m", "maskln_cli"]


def targets(timeout: float) -> dict[str, list[str]]:
    """The targets timed, by name: the correct solutions of bench.py's figure 12, then two more."""
    return {
        **{f"correct ({name}), --strict": args for name, args in GRADE_CORRECT.items()},
        "examples/first_attempt.py": ["examples/first_attempt.py"],
        f"hanging, --timeout {timeout:g}": [
            "tests/solutions/misbehaving.py:hangs",
            "--timeout",
            f"{timeout:g}",
        ],
    }


def wall_time(arguments: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    done = subprocess.run(
        [*MASKLN, "grade", *arguments, "--quiet"], cwd=ROOT, capture_output=True, check=False
    )
    if done.returncode not in (0, 1):
        raise SystemExit(f"maskln grade {' '.join(arguments)} failed: {done.stderr.decode()}")
    return time.perf_counter() - start, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=5.0)
    options = parser.parse_args()
    print(f"maskln grade wall time, {options.repeat} runs each, {os.cpu_count()} cores")
    print()
    print("| target | exit | min s | median s | max s |")
    print("|---|---:|---:|---:|---:|")
    start = cpu_snapshot()
    for name, arguments in targets(options.timeout).items():
        times, codes = [], set()
        for _ in range(options.repeat):
            seconds, code = wall_time(arguments)
            times.append(seconds)
            codes.add(code)
            print(f"  {name}: {seconds:.1f} s", file=sys.stderr)
        exits = ",".join(map(str, sorted(codes)))
        print(
            f"| {name} | {exits} | {min(times):.1f} | {statistics.median(times):.1f}"
            f" | {max(times):.1f} |"
        )
    end = cpu_snapshot()
    print()
    print(
        f"other processes kept {background_load(start, end):.1f} of {os.cpu_count()} cores busy"
        " meanwhile (on average)"
    )


if __name__ == "__main__":
    main()
