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

The repetitions are interleaved (one run of each target in turn, then again), so that a change
in the machine's load touches every target alike.

    .venv/bin/python benchmarks/grade_wall_time.py --refusals     # usage errors, before torch
    .venv/bin/python benchmarks/grade_wall_time.py --class 30     # a class of 30 submissions

``--refusals`` times a missing TARGET and a bad ``--only`` (refused before torch is imported:
target 0.5 s) beside ``maskln --help`` (their peer: Python and the CLI's start-up).
``--class N`` grades a folder of N submissions (correct ones in several styles and one-mistake
ones, from tests/solutions/, cycled) with ``--jobs`` (default: the CPU count), once per
repetition.

Prints min, median and max wall seconds per target, and how many cores other processes kept
busy meanwhile (well above 0: the machine was shared, rerun before drawing conclusions).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
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


REFUSALS = {
    "maskln --help (the peer)": ["--help"],
    "grade no/such/solution.py": ["grade", "no/such/solution.py"],
    "grade --only nope": ["grade", "examples/first_attempt.py", "--only", "nope"],
}

CLASS_SOURCES = [
    "from tests.solutions.correct import masked_layer_normalization",
    "from tests.solutions.variants import welford as masked_layer_normalization",
    "from tests.solutions.variants import var_mean as masked_layer_normalization",
    "from tests.solutions.mistakes import unbiased_variance as masked_layer_normalization",
    "from tests.solutions.mistakes import eps_outside_sqrt as masked_layer_normalization",
    "from tests.solutions.precision import float64_computed_in_float32 as"
    " masked_layer_normalization",
    "from tests.solutions.false_passes import all_invalid_times_zero as masked_layer_normalization",
]


def wall_time(arguments: list[str], codes: tuple[int, ...] = (0, 1)) -> tuple[float, int]:
    start = time.perf_counter()
    quiet = ["--quiet"] if codes == (0, 1) else []  # a grade; refusals print one line anyway
    command = [*MASKLN, *arguments, *quiet]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, check=False)
    if done.returncode not in codes:
        raise SystemExit(f"maskln {' '.join(arguments)} failed: {done.stderr.decode()}")
    return time.perf_counter() - start, done.returncode


def write_class(folder: Path, count: int) -> None:
    """``count`` submissions, cycling through :data:`CLASS_SOURCES`."""
    for i in range(count):
        source = CLASS_SOURCES[i % len(CLASS_SOURCES)]
        (folder / f"student_{i:03}.py").write_text(source + "  # noqa: F401\n")


def measure(runs: dict[str, list[str]], repeat: int, codes: tuple[int, ...] = (0, 1)) -> None:
    """Each of ``runs``, ``repeat`` times, interleaved; a table row each."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    exits: dict[str, set[int]] = {name: set() for name in runs}
    for _ in range(repeat):
        for name, arguments in runs.items():
            seconds, code = wall_time(arguments, codes)
            times[name].append(seconds)
            exits[name].add(code)
            print(f"  {name}: {seconds:.2f} s", file=sys.stderr)
    for name in runs:
        row = times[name]
        print(
            f"| {name} | {','.join(map(str, sorted(exits[name])))} | {min(row):.2f}"
            f" | {statistics.median(row):.2f} | {max(row):.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--refusals", action="store_true", help="time usage errors only")
    parser.add_argument("--class", dest="size", type=int, help="time a class of this many")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    options = parser.parse_args()
    print(f"maskln wall time, {options.repeat} runs each, interleaved, {os.cpu_count()} cores")
    print()
    print("| run | exit | min s | median s | max s |")
    print("|---|---:|---:|---:|---:|")
    start = cpu_snapshot()
    if options.refusals:
        measure(REFUSALS, options.repeat, codes=(0, 2))
    elif options.size:
        with tempfile.TemporaryDirectory() as folder:
            write_class(Path(folder), options.size)
            name = f"a class of {options.size}, --jobs {options.jobs}"
            measure({name: ["grade", folder, "--jobs", str(options.jobs)]}, options.repeat)
    else:
        runs = {name: ["grade", *args] for name, args in targets(options.timeout).items()}
        measure(runs, options.repeat)
    end = cpu_snapshot()
    print()
    print(
        f"other processes kept {background_load(start, end):.1f} of {os.cpu_count()} cores busy"
        " meanwhile (on average)"
    )


if __name__ == "__main__":
    main()
