"""How ``maskln verify`` judges correct and wrong kernels, over several seeds: the measurements
behind ``--factor``'s default (docs/verify-budget.md, "Choosing --factor").

Run from the repository root with the project's interpreter::

    .venv/bin/python benchmarks/verify_calibration.py              # 5 seeds, ~10 minutes
    .venv/bin/python benchmarks/verify_calibration.py --seeds 2    # quicker
    .venv/bin/python benchmarks/verify_calibration.py --long       # also C = 2**20 rows
    .venv/bin/python benchmarks/verify_calibration.py --systematic # the systematic-error test

Each kernel of tests/kernels.py runs on each data set (written to a file, as a kernel's output
would be) and ``maskln verify`` judges it in-process. For every (kernel, data set, seed) the
script records the verdict and the **factor needed**: the smallest ``--factor`` at which every
tensor's values would pass (``inf`` when no factor would: NaN where the reference is finite,
padding not zeroed). It does so twice: with the budget as ``verify`` uses it (the model, raised
where PyTorch's own error is higher), and with the model alone, which shows how well the model
covers PyTorch's own rounding.

Prints a Markdown table (kernels by data set: verdict, factor needed over the seeds, worst for
correct kernels and best for wrong ones, and the diagnosis) and, per seed, the margins: the
worst factor a correct kernel needs against the best a wrong kernel needs, where its mistake is
visible at all.

``--systematic`` calibrates the systematic-error test (maskln_cli/verify/systematic.py) instead:
for C from 1 to 65,536 and each seed, correct kernels (sequential, pairwise, Welford, Kahan,
blocked, F.layer_norm, and F.layer_norm in bfloat16 and float16, which accumulate in float32)
and the mistakes a budget hides at wide rows (eps 1e-6 or 3e-5 for 1e-5, out times 1 + 1e-5),
each with its gradients (autograd through its own ops); it prints the FAIL counts by C for each
tensor: 0 for every correct kernel, all for every mistake from C = 64 in out, grad_x and
grad_scale; and the greatest pooled factor of 6 valid rows over the few-rows limit (below 1:
a correct kernel passes with fewer than 8 valid rows).

``--rows`` calibrates each row judged alone (``ROW_LIMIT``): the greatest ratio of a correct
kernel's row factor to its limit, by C, number of rows and tensor (below 1: it passes).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maskln_cli.verify import job as verify_module
from maskln_cli.verify import systematic
from maskln_cli.verify.job import VerifyOptions, verify_file
from tests import kernels

DataSet = Callable[[int], kernels.Tensors]


@dataclass
class Case:
    """A data set, the dtype kernels run in, and the kernels to judge on it."""

    name: str
    make: DataSet
    dtype: torch.dtype
    correct: dict[str, kernels.Kernel]
    wrong: dict[str, kernels.Kernel] = field(default_factory=dict)
    padding_zeroed: bool = False


def float32_cases() -> list[Case]:
    return [
        Case(
            f"offset {offset:g}",
            lambda seed, offset=offset: kernels.offset_batch(offset, seed),
            torch.float32,
            kernels.CORRECT,
            kernels.WRONG,
        )
        for offset in (0.0, 1e3, 1e4)
    ] + [
        Case(
            "spread 1e-2..10",
            lambda seed: kernels.spread_batch(seed),
            torch.float32,
            kernels.CORRECT,
            kernels.WRONG,
        )
    ]


def half_cases() -> list[Case]:
    layer_norm = {"nn.LayerNorm": kernels.torch_layer_norm, "maskln": kernels.maskln}
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        cases.append(
            Case(
                f"{name} data",
                lambda seed, name=name: kernels.offset_batch(0.0, seed, dtype=name),
                dtype,
                layer_norm,
                padding_zeroed=True,
            )
        )
        cases.append(
            Case(
                f"float32 data, {name} kernel",
                lambda seed: kernels.offset_batch(0.0, seed),
                dtype,
                layer_norm,
                padding_zeroed=True,
            )
        )
    return cases


def long_cases() -> list[Case]:
    correct = {k: kernels.CORRECT[k] for k in ("F.layer_norm", "two-pass", "maskln")}
    return [Case("C = 2**20", lambda seed: kernels.long_rows(seed), torch.float32, correct)]


@dataclass
class Outcome:
    passed: bool
    needed: float  # the factor needed, with the yardstick (inf: no factor would do)
    model_needed: float  # the same, with the model alone
    diagnosis: list[str]


def judge(
    inputs: kernels.Tensors, result: kernels.Tensors, folder: Path, model_alone: bool
) -> Outcome:
    """verify's verdict; with ``model_alone``, also the factor needed by the model alone (for
    correct kernels: the yardstick only raises budgets, so a wrong kernel needs as much or
    more without it)."""
    source, target = folder / "in.safetensors", folder / "result.safetensors"
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(source), {"eps": "1e-05"})
    save_file({k: v.contiguous() for k, v in result.items()}, str(target))
    figures = []
    for raises in (True, False) if model_alone else (True,):
        verify_module.YARDSTICK_RAISES = raises
        try:
            report = verify_file(str(source), str(target), verify=VerifyOptions())
        finally:
            verify_module.YARDSTICK_RAISES = True
        needed = max(
            math.inf if t.factor_needed is None else t.factor_needed for t in report.tensors
        )
        figures.append((report, needed))
    (report, needed), (_, model_needed) = figures if model_alone else figures * 2
    names = [d["mistake"] for t in report.tensors for d in t.diagnosis]
    return Outcome(report.passed, needed, model_needed, list(dict.fromkeys(names)))


SYSTEMATIC_CHANNELS = (1, 2, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
SYSTEMATIC_ELEMENTS = 1 << 19
"""Elements of x per (C, seed): rows of C channels, 16 rows at least."""
HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}
TENSORS = ("out", "grad_x", "grad_scale", "grad_bias")
SYSTEMATIC_IN = ("out", "grad_x", "grad_scale")
"""The tensors the hidden mistakes make systematic (grad_bias sums grad_out alone)."""


def systematic_data(channels: int, seed: int) -> kernels.Tensors:
    """N(0, 1) rows of ``channels`` (30 % padding, poisoned), with an upstream gradient."""
    from maskln_cli.jobs.generate import generate_inputs

    rows = max(16, SYSTEMATIC_ELEMENTS // channels)
    return generate_inputs((rows, channels), "float32", seed, invalid=0.3, poison=True, grad=True)


def systematic_run(kernel: kernels.Kernel, inputs: kernels.Tensors, dtype: torch.dtype):
    """out and the gradients of ``kernel`` in ``dtype`` (autograd through its own ops; half
    kernels: F.layer_norm, which accumulates in float32), the padding zeroed."""
    return kernels.zero_padding(kernels.run(kernel, inputs, dtype), inputs["valid"])


FEW_ROWS = 6
"""The valid rows of the few-rows calibration: groups of this many consecutive rows."""


def single_rows(inputs: kernels.Tensors, result: kernels.Tensors, dtype: torch.dtype) -> float:
    """What a dump of FEW_ROWS valid rows would show: over groups of that many valid rows of
    out and grad_x (grad_x from C = 4, its rows that are no cancellation, as verify regresses
    them), the greatest pooled factor (their errors regressed on the truth, pooled with the
    same weights; 0 unless every row's factor has its sign) over the few-rows limit (twice the
    gate, or systematic.FEW_ROWS_ULPS): below 1 passes with fewer than 8 valid rows."""
    from maskln_cli.verify.blockwork import CANCELLED, GRAD_X_CHANNELS
    from maskln_cli.verify.budget import Precision
    from maskln_cli.verify.systematic import FEW_ROWS_CHANNELS, FEW_ROWS_ULPS, systematic_gate

    as_float64 = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    truth = kernels.run(kernels.two_pass, as_float64)
    valid, channels = inputs["valid"], inputs["x"].shape[-1]
    if channels < FEW_ROWS_CHANNELS:  # not tested (the verdict says so)
        return 0.0
    precision = Precision.of(dtype, torch.float32, torch.float32, torch.float32)
    ratio = float(inputs["bias"].square().mean().sqrt() / inputs["scale"].square().mean().sqrt())
    x = as_float64["x"][valid]
    rstd = (x.var(-1, unbiased=False) + kernels.EPS).rsqrt()
    worst = 0.0
    for name in ("out", "grad_x") if channels >= GRAD_X_CHANNELS else ("out",):
        bias = as_float64["bias"] if name == "out" else 0.0
        gate = systematic_gate(precision, 0.0, ratio if name == "out" else 0.0)
        limit = max(2 * gate, FEW_ROWS_ULPS * channels**0.5 * precision.reduce)
        z = truth[name][valid] - bias
        error = result[name].double()[valid] - truth[name][valid]
        keep = torch.ones(len(z), dtype=torch.bool)
        if name == "grad_x":  # as verify: rows whose grad_x is not a cancellation
            terms = (as_float64["grad_out"][valid] * as_float64["scale"]).square().sum(-1)
            keep = z.square().sum(-1) >= CANCELLED * terms * rstd.square()
        z, error = z[keep], error[keep]
        centered = z - z.mean(-1, keepdim=True)
        weights = centered.square().sum(-1)
        factors = (centered * error).sum(-1) / weights
        for start in range(0, len(factors) - FEW_ROWS + 1, FEW_ROWS):
            f, w = factors[start : start + FEW_ROWS], weights[start : start + FEW_ROWS]
            pooled = float((w * f).sum() / w.sum())
            if bool((f * pooled > 0).all()):
                worst = max(worst, abs(pooled) / limit)
    return worst


def systematic_main(seeds: int) -> None:
    """Correct kernels never fail, at any C, in any tensor; the mistakes that hide in the budget
    at wide rows fail at every C >= 64 (issue 23, 5), in out, grad_x and grad_scale (issue 33,
    2). Prints a Markdown table of verdicts by C per tensor, and the single-row margins."""
    contenders = [(f"{name}", kernel, torch.float32, False) for name, kernel in
                  kernels.SYSTEMATIC_CORRECT.items()]  # fmt: skip
    contenders += [
        (f"F.layer_norm in {name}", kernels.torch_layer_norm, dtype, False)
        for name, dtype in HALF.items()
    ]
    contenders += [(name, k, torch.float32, True) for name, k in kernels.SYSTEMATIC_WRONG.items()]
    systematic.ALWAYS_REPORT = True  # every pooled factor, and its score
    # (kernel, C) -> runs of {tensor: (passed, score, budget ratio)}, and single-row shares
    table: dict[tuple[str, int], list[dict[str, tuple[bool, float, float]]]] = {}
    rows_share: dict[tuple[str, int], float] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        for channels in SYSTEMATIC_CHANNELS:
            for seed in range(seeds):
                inputs = systematic_data(channels, seed)
                for name, kernel, dtype, wrong in contenders:
                    if channels > 4096 and name in ("sequential", "Welford", "Kahan") and seed:
                        continue  # element-by-element loops in Python: one seed is enough
                    result = systematic_run(kernel, inputs, dtype)
                    report = _verify(inputs, result, folder)
                    run = {
                        t.name: (t.passed, (t.systematic or {}).get("score", 0.0),
                                 t.budget_ratio or 0.0)
                        for t in report.tensors
                    }  # fmt: skip
                    table.setdefault((name, channels), []).append(run)
                    if not wrong:
                        share = single_rows(inputs, result, dtype)
                        key = (name, channels)
                        rows_share[key] = max(rows_share.get(key, 0.0), share)
                    print(
                        f"C {channels:>6} seed {seed} {name:>24}:"
                        f" {'PASS' if report.passed else 'FAIL'} scores "
                        + " ".join(f"{n} {run[n][1]:.2g}" for n in TENSORS),
                        file=sys.stderr,
                    )
    print("FAIL count / runs by C; `*`: some failed within the budget (the systematic test")
    print("alone fails them); then the systematic score (> 1: systematic), the greatest of a")
    print("correct kernel's runs, the smallest of a mistake's (grad_bias: not made wrong)")
    for tensor in TENSORS:
        print(f"\n{tensor}\n")
        print("| kernel | " + " | ".join(f"C={c:,}" for c in SYSTEMATIC_CHANNELS) + " |")
        print("|---|" + "---:|" * len(SYSTEMATIC_CHANNELS))
        for name, _, _, wrong in contenders:
            if wrong and tensor not in SYSTEMATIC_IN:
                continue
            cells = []
            for channels in SYSTEMATIC_CHANNELS:
                runs = [run[tensor] for run in table.get((name, channels), [])]
                failed = sum(not passed for passed, _, _ in runs)
                hidden = sum(not passed and ratio <= 1 for passed, _, ratio in runs)
                scores = [score for _, score, _ in runs]
                score = (min if wrong else max)(scores) if scores else 0.0
                cells.append(f"{failed}/{len(runs)}{'*' if hidden else ''} ({score:.2g})")
            label = f"{name} (wrong)" if wrong else name
            print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"\nthe greatest pooled factor of {FEW_ROWS} valid rows of out or grad_x over the")
    print("few-rows limit, by C (correct kernels; below 1 passes with fewer than 8 valid rows)\n")
    print("| kernel | " + " | ".join(f"C={c:,}" for c in SYSTEMATIC_CHANNELS) + " |")
    print("|---|" + "---:|" * len(SYSTEMATIC_CHANNELS))
    for name, _, _, wrong in contenders:
        if not wrong:
            cells = [f"{rows_share.get((name, c), 0.0):.2g}" for c in SYSTEMATIC_CHANNELS]
            print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\nran in {time.monotonic() - started:.0f} s")


ROWS_KERNELS = {
    "F.layer_norm": kernels.torch_layer_norm,
    "two-pass": kernels.two_pass,
    "sequential": kernels.sequential,
    "Welford": kernels.welford,
    "Kahan": kernels.kahan,
    "maskln": kernels.maskln,
    **kernels.BACKWARD_CORRECT,
}
LOOPS = {"sequential", "Welford", "Kahan", "written, sequential sums",
         "written, torch's form, sequential sums"}  # fmt: skip


def rows_main(seeds: int) -> None:
    """``--rows``: each row judged alone (maskln_cli/verify/systematic.py, ROW_LIMIT): for C
    from 16 to 4,096 (and 65,536 on 6 rows), sets of 6 rows and of up to 4,096, rows of x =
    offset + N(0, 1) (offsets 0, 1e3, 1e4) or of spreads 1e-2 to 10, correct kernels with their
    gradients in float32 (and F.layer_norm and the hand-written ones in float16, bfloat16):
    the greatest ratio of a row's factor to its limit (``row_score``: 1 would fail), by C and
    tensor, and any failure."""
    from maskln_cli.jobs.generate import generate_inputs
    from maskln_cli.testing import verify

    systematic.ALWAYS_REPORT = True
    worst: dict[tuple[int, int, str], tuple] = {}
    for channels, rows in [(c, r) for c in (16, 64, 768, 4096) for r in (6, 4096)] + [(65536, 6)]:
        rows = min(rows, max(6, (1 << 20) // channels))
        for data in ("0", "1e3", "1e4", "spread"):
            for seed in range(seeds):
                inputs = generate_inputs((rows, channels), "float32", seed, invalid=0.0, grad=True)
                x = inputs["x"].double()
                if data == "spread":
                    g = torch.Generator().manual_seed(seed)
                    spread = 10 ** (3 * torch.rand(rows, 1, generator=g, dtype=torch.float64) - 2)
                    x = x * spread + torch.randn(rows, 1, generator=g, dtype=torch.float64)
                inputs["x"] = (x + (0.0 if data == "spread" else float(data))).float()
                for dtype in ("float32", "float16", "bfloat16"):
                    for name, kernel in ROWS_KERNELS.items():
                        half = name == "F.layer_norm" or name in kernels.BACKWARD_CORRECT
                        if dtype != "float32" and not half:
                            continue
                        # A sequential float32 sum of 65,536 values of 1e4 stagnates (the row
                        # off by 70 %): no correct kernel there; loops are slow above 4,096.
                        if name in LOOPS and channels > 4096 and (rows > 6 or data == "1e4"):
                            continue
                        if name in LOOPS and rows > 256 and channels > 64:
                            continue
                        cast = {
                            k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v
                            for k, v in inputs.items()
                        }
                        result = kernels.run(kernel, cast)
                        report = verify(
                            result["out"], cast["x"], cast["valid"], cast["scale"],
                            cast["bias"], 1e-5, grad_out=cast["grad_out"],
                            grad_x=result["grad_x"], grad_scale=result["grad_scale"],
                            grad_bias=result["grad_bias"],
                        )  # fmt: skip
                        for tensor in report.tensors:
                            if not tensor.passed:
                                print(f"FAIL C={channels} rows={rows} {data} {dtype} {name}"
                                      f" {tensor.name}: {tensor.problems}")  # fmt: skip
                            if tensor.name in ("out", "grad_x") and tensor.systematic:
                                score = tensor.systematic.get("row_score", 0.0)
                                key = (channels, rows, tensor.name)
                                if score > worst.get(key, (0.0,))[0]:
                                    worst[key] = (score, name, data, dtype)
    print("| C | rows | tensor | greatest row_score | kernel, data, dtype |")
    print("|---:|---:|---|---:|---|")
    for (channels, rows, name), (score, kernel, data, dtype) in sorted(worst.items()):
        print(f"| {channels:,} | {rows:,} | {name} | {score:.2f} | {kernel}, {data}, {dtype} |")


def _verify(inputs: kernels.Tensors, result: kernels.Tensors, folder: Path):
    source, target = folder / "in.safetensors", folder / "result.safetensors"
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(source), {"eps": "1e-05"})
    save_file({k: v.contiguous() for k, v in result.items()}, str(target))
    return verify_file(str(source), str(target), verify=VerifyOptions())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--long", action="store_true", help="also the C = 2**20 case")
    parser.add_argument("--no-half", action="store_true", help="skip bfloat16 and float16")
    parser.add_argument(
        "--systematic",
        action="store_true",
        help="the systematic-error test instead: correct kernels and hidden mistakes, C from 1"
        " to 65,536",
    )
    parser.add_argument(
        "--rows", action="store_true", help="each row judged alone instead: correct kernels' rows"
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.systematic:
        systematic_main(args.seeds)
        return
    if args.rows:
        rows_main(args.seeds)
        return
    cases = float32_cases() + ([] if args.no_half else half_cases())
    cases += long_cases() if args.long else []
    results: dict[tuple[str, str], list[Outcome]] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        for case in cases:
            for seed in range(args.seeds):
                inputs = case.make(seed)
                for name, kernel in {**case.correct, **case.wrong}.items():
                    result = kernels.run(kernel, inputs, case.dtype)
                    if case.padding_zeroed:
                        result = kernels.zero_padding(result, inputs["valid"])
                    outcome = judge(inputs, result, folder, name in case.correct)
                    results.setdefault((case.name, name), []).append(outcome)
                    print(
                        f"{case.name:>28} seed {seed} {name:>22}: "
                        f"{'PASS' if outcome.passed else 'FAIL'} needs {outcome.needed:.3g}"
                        f" (model alone {outcome.model_needed:.3g}) {outcome.diagnosis}",
                        file=sys.stderr,
                    )
    print_table(cases, results, args.seeds)
    print(f"\nran in {time.monotonic() - started:.0f} s, --factor {verify_module_factor()}")


def verify_module_factor() -> float:
    from maskln_cli.verify.budget import DEFAULT_FACTOR

    return DEFAULT_FACTOR


def print_table(cases: list[Case], results: dict, seeds: int) -> None:
    print("| data | kernel | verdicts | factor needed | model alone | diagnosis |")
    # model alone: for wrong kernels, the same or more (the yardstick only raises budgets)
    print("|---|---|---|---:|---:|---|")
    for case in cases:
        for name in {**case.correct, **case.wrong}:
            outcomes = results[(case.name, name)]
            wrong = name in case.wrong
            passes = sum(o.passed for o in outcomes)
            verdict = f"{passes} PASS, {len(outcomes) - passes} FAIL"
            pick = min if wrong else max
            needed = pick(o.needed for o in outcomes)
            model = _figure(max(o.model_needed for o in outcomes)) if not wrong else "-"
            diagnosis = sorted({d for o in outcomes for d in o.diagnosis})
            label = f"{name} (wrong)" if wrong else name
            print(
                f"| {case.name} | {label} | {verdict} | {_figure(needed)} | {model} |"
                f" {', '.join(diagnosis) or '-'} |"
            )
    print("\nper seed: worst factor a correct kernel needs / best a wrong kernel needs")
    print("(wrong kernels whose mistake is below the data's float32 resolution, passing at")
    print(" --factor 3, are left out; the table lists them)\n")
    print("| seed | worst correct | (kernel, data) | best wrong | (kernel, data) |")
    print("|---:|---:|---|---:|---|")
    for seed in range(seeds):
        correct, wrong = [], []
        for case in cases:
            for name in case.correct:
                correct.append((results[(case.name, name)][seed].needed, name, case.name))
            for name in case.wrong:
                outcome = results[(case.name, name)][seed]
                if not outcome.passed:
                    wrong.append((outcome.needed, name, case.name))
        worst = max(correct)
        best = min(wrong) if wrong else (math.inf, "-", "-")
        print(
            f"| {seed} | {_figure(worst[0])} | {worst[1]}, {worst[2]} | {_figure(best[0])} |"
            f" {best[1]}, {best[2]} |"
        )


def _figure(value: float) -> str:
    if math.isinf(value):
        return "inf"
    return f"{value:,.0f}" if value >= 100 else f"{value:.2g}"


if __name__ == "__main__":
    main()
