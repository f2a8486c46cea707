"""Margins of the accuracy clauses over many seeds: two_pass (RMS error within 4x
F.layer_norm's) and offset_accuracy (strict, 2x), for correct implementations written in
different ways and for a one-pass variance, through the grader's own cases, run and judge.

    .venv/bin/python benchmarks/accuracy_margins.py               # seeds 0 to 299
    .venv/bin/python benchmarks/accuracy_margins.py --seeds 1000

For each clause and implementation: the smallest and largest ratio over the seeds of its
relative RMS error to F.layer_norm's (the largest over the clause's datasets), and the seeds
at which the clause failed. A correct kernel must pass two_pass at every seed, with its
largest ratio well under 4; a one-pass variance must fail it at every seed by far.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maskln_cli import masked_layer_normalization
from maskln_cli.grading.clauses import CLAUSES, layer_norm_error, relative_rms_error, run_clause
from tests.solutions import broken, correct, variants

IMPLEMENTATIONS = {
    "tests/solutions/correct.py": correct.masked_layer_normalization,
    "maskln's op": masked_layer_normalization,
    "variants.welford": variants.welford,
    "variants.var_mean": variants.var_mean,
    "variants.float64_inside": variants.float64_inside,
    "variants.matmul_means": variants.matmul_means,
    "variants.channel_loop": variants.channel_loop,
    "broken.one_pass_variance (wrong)": broken.one_pass_variance,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=300)
    parser.add_argument("--clauses", default="two_pass,offset_accuracy")
    arguments = parser.parse_args()
    torch.set_num_threads(1)  # the results do not depend on it; the machine may be shared
    started = time.perf_counter()
    for name in arguments.clauses.split(","):
        clause = CLAUSES[name]
        ratios: dict[str, list[float]] = {key: [] for key in IMPLEMENTATIONS}
        failures: dict[str, list[int]] = {key: [] for key in IMPLEMENTATIONS}
        for seed in range(arguments.seeds):
            cases = clause.build(seed)
            references = [case.reference() for case in cases]
            yardsticks = [layer_norm_error(case) for case in cases]
            for key, fn in IMPLEMENTATIONS.items():
                run = run_clause(fn, name, seed, "cpu", cases)
                ratios[key].append(
                    max(
                        relative_rms_error(run.tensors[f"{i}.out"], references[i]) / yardstick
                        for i, yardstick in enumerate(yardsticks)
                    )
                )
                if not clause.judge(cases, run).passed:
                    failures[key].append(seed)
        print(f"{name} (seeds 0 to {arguments.seeds - 1}): RMS error / F.layer_norm's")
        for key in IMPLEMENTATIONS:
            shown = ", ".join(map(str, failures[key][:5])) + (
                ", ..." if len(failures[key]) > 5 else ""
            )
            print(
                f"  {key:34s} min {min(ratios[key]):10.3f}  max {max(ratios[key]):10.3f}"
                f"  failed at {len(failures[key])} seeds{': ' + shown if shown else ''}"
            )
    print(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
