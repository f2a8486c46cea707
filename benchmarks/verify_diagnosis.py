"""How ``maskln verify`` diagnoses wrong kernels: a confusion table of true mistake by named cause.

Run from the repository root with the project's interpreter::

    .venv/bin/python benchmarks/verify_diagnosis.py                # the table, ~5 minutes
    .venv/bin/python benchmarks/verify_diagnosis.py --update-docs  # and into the docs page
    .venv/bin/python benchmarks/verify_diagnosis.py --only "c1 over C - 1" --verbose
    .venv/bin/python benchmarks/verify_diagnosis.py --correct        # no correct kernel fails

Each wrong kernel of ``tests.kernels.CATALOGUE`` (one subtle mistake each, in its forward or in
its hand-written backward) runs on each data family of ``tests.kernels.DATA_FAMILIES``, in each
of its dtypes, with the upstream gradient at three scales (1, 1e-3, 1e-6), and
:func:`maskln_cli.testing.verify` judges out and the three gradients (the judgement ``maskln
verify`` makes of the same tensors in files). A run's **named causes** are the diagnoses of its
failing tensors. The table counts, for each kernel, the runs that passed (the mistake invisible
on that data, or within the budget), the runs that failed with no cause named, and the runs
naming each cause; a cause outside the kernel's own (``tests.kernels.Wrong.causes``) is a
**wrong cause**, and the script exits 1 if any run names one.

``--correct`` runs the correct kernels of ``tests.kernels.CORRECT_EVERYWHERE`` the same way
instead (each in the dtypes it is correct in, float64 included): every run must pass, and the
script prints the greatest factor any needed.

``--norm rms`` measures RMSNorm's diagnosis instead: each wrong RMSNorm kernel of
``tests.verify.test_rms_diagnosis.CAUSES`` (the mistakes of issue 39) on each of its
``FAMILIES``, in float32 (and float16 and bfloat16 for those of its ``HALF``), at the same
upstream scales; its table goes between the markers ``<!-- rms diagnosis table -->``.

``--update-docs`` writes the table between the markers of ``docs/verify-budget.md``
(``<!-- diagnosis table -->``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from maskln_cli.testing import verify  # noqa: E402
from tests import kernels  # noqa: E402
from tests.verify import test_rms_diagnosis as rms  # noqa: E402

SCALES = (1.0, 1e-3, 1e-6)
"""The upstream gradient's scales: the usual, and the tiny gradients of early layers."""
PASSED = "passed"
UNNAMED = "no cause named"
RUNS = "runs"
DOCS = ROOT / "docs" / "verify-budget.md"
MARKER = "<!-- diagnosis table -->"
MARKERS = {"layer": MARKER, "rms": "<!-- rms diagnosis table -->"}


def judged(
    name: str, family: str, dtype: str, scale: float, seed: int, norm: str = "layer"
) -> tuple[bool, set[str]]:
    """One run: whether it passed, and the causes its failing tensors were given."""
    if norm == "rms":
        report = rms.judged(name, family, getattr(torch, dtype), seed=seed, upstream=scale)
    else:
        report = judge(kernels.CATALOGUE[name].kernel, family, dtype, scale, seed)
    causes = {d["mistake"] for t in report.tensors if not t.passed for d in t.diagnosis}
    return report.passed, causes


def allowed(name: str, norm: str) -> set[str]:
    """The causes kernel ``name`` may be given: its own."""
    if norm == "rms":
        return {rms.CAUSES[name]} - {None}
    return set(kernels.CATALOGUE[name].causes)


def judge(kernel: kernels.Kernel, family: str, dtype: str, scale: float, seed: int):
    """``kernel`` on a data family, judged in memory: the report."""
    inputs = kernels.DATA_FAMILIES[family](seed, dtype=dtype)
    inputs["grad_out"] = (inputs["grad_out"].double() * scale).to(inputs["grad_out"].dtype)
    result = kernels.run(kernel, inputs)
    report = verify(
        result["out"], inputs["x"], inputs["valid"], inputs["scale"], inputs["bias"], 1e-5,
        grad_out=inputs["grad_out"], grad_x=result["grad_x"], grad_scale=result["grad_scale"],
        grad_bias=result["grad_bias"],
    )  # fmt: skip
    return report


def false_fails(seeds: int) -> int:
    """Every correct kernel (``tests.kernels.CORRECT_EVERYWHERE``) on every data family, in
    each of its dtypes, at every scale: the runs that fail (printed) and the worst factor
    needed. Returns the count of failing runs."""
    runs, failing, worst = 0, 0, (0.0, "")
    for name, (kernel, dtypes) in kernels.CORRECT_EVERYWHERE.items():
        for dtype in dtypes:
            for family in kernels.DATA_FAMILIES:
                if family == "N(0, 300)" and dtype != "float16":
                    continue  # made to overflow float16 (a correct float16 kernel holds it)
                for scale in SCALES:
                    for seed in range(seeds):
                        report = judge(kernel, family, dtype, scale, seed)
                        runs += 1
                        needed = max(t.factor_needed or 0.0 for t in report.tensors)
                        if needed > worst[0]:
                            worst = (needed, f"{name}, {family}, {dtype}, {scale:g}")
                        if not report.passed:
                            failing += 1
                            print(
                                f"FALSE FAIL: {name} | {family} | {dtype} | {scale:g} |"
                                f" {[t.problems for t in report.tensors if not t.passed]}"
                            )
    print(f"{runs} runs of correct kernels, {failing} failing; the greatest factor needed"
          f" {worst[0]:.2g} ({worst[1]})")  # fmt: skip
    return failing


def runs(
    names: list[str], seeds: int, norm: str = "layer"
) -> list[tuple[str, str, str, float, int]]:
    """Every (kernel, family, dtype, scale, seed) judged: half-dtype kernels on every family,
    float32 ones on every family but the one made to overflow float16 (RMSNorm's: float32 but
    for half accumulation, float16 and bfloat16 for those of ``rms.HALF``)."""
    if norm == "rms":
        return [
            (name, family, dtype, scale, seed)
            for name in names
            for dtype in ("float32", "float16", "bfloat16")
            if (dtype != "float32" and name in rms.HALF)
            or (dtype == "float32" and name != "half accumulation")
            for family in rms.FAMILIES
            for scale in SCALES
            for seed in range(seeds)
        ]
    return [
        (name, family, dtype, scale, seed)
        for name in names
        for dtype in kernels.CATALOGUE[name].dtypes
        for family in kernels.DATA_FAMILIES
        if dtype != "float32" or family != "N(0, 300)"
        for scale in SCALES
        for seed in range(seeds)
    ]


def table(counts: dict[str, Counter], names: list[str], norm: str = "layer") -> str:
    """The confusion table in Markdown: a row per kernel, a column per outcome."""
    causes = sorted({c for row in counts.values() for c in row} - {PASSED, UNNAMED, RUNS})
    columns = [PASSED, UNNAMED, *causes]
    header = ["true mistake", "runs", *columns]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for name in names:
        row = counts[name]
        own = allowed(name, norm)
        cells = []
        for column in columns:
            count = row.get(column, 0)
            text = str(count) if count else "·"
            if count and column in own:
                text = f"**{count}**"
            elif count and column not in (PASSED, UNNAMED):
                text = f"{count} (wrong)"
            cells.append(text)
        lines.append(f"| {name} | {row[RUNS]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def confusion(
    names: list[str], seeds: int, verbose: bool = False, norm: str = "layer"
) -> tuple[dict[str, Counter], list[tuple]]:
    """The confusion table's counts (kernel -> outcome -> runs) over :func:`runs`, and the
    runs that named a wrong cause (each printed, and every run with ``verbose``)."""
    counts: dict[str, Counter] = defaultdict(Counter)
    wrong_runs = []
    for name, family, dtype, scale, seed in runs(names, seeds, norm):
        passed, causes = judged(name, family, dtype, scale, seed, norm)
        counts[name][RUNS] += 1
        if passed:
            counts[name][PASSED] += 1
        elif not causes:
            counts[name][UNNAMED] += 1
        for cause in causes:
            counts[name][cause] += 1
        wrong = causes - allowed(name, norm)
        if wrong:
            wrong_runs.append((name, family, dtype, scale, seed, sorted(wrong)))
        if verbose or wrong:
            verdict = "PASS" if passed else "FAIL"
            said = ", ".join(sorted(causes)) or "-"
            flag = "  WRONG" if wrong else ""
            print(f"{name} | {family} | {dtype} | {scale:g} | {verdict} | {said}{flag}")
    return counts, wrong_runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--only", action="append", help="a kernel of the catalogue (repeatable)")
    parser.add_argument("--verbose", action="store_true", help="print every run")
    parser.add_argument("--update-docs", action="store_true")
    parser.add_argument("--norm", choices=["layer", "rms"], default="layer")
    parser.add_argument(
        "--correct", action="store_true", help="the correct kernels instead: no run may fail"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.correct:
        return 1 if false_fails(args.seeds) else 0
    catalogue = rms.CAUSES if args.norm == "rms" else kernels.CATALOGUE
    names = args.only or list(catalogue)
    start = time.perf_counter()
    counts, wrong_runs = confusion(names, args.seeds, args.verbose, args.norm)
    text = table(counts, names, args.norm)
    total = sum(row[RUNS] for row in counts.values())
    print(text)
    print(f"\n{total} runs, {len(wrong_runs)} naming a wrong cause"
          f" ({time.perf_counter() - start:.0f} s)")  # fmt: skip
    if args.update_docs:
        page = DOCS.read_text()
        marker = MARKERS[args.norm]
        head, _, rest = page.partition(marker)
        _, _, tail = rest.partition(marker)
        DOCS.write_text(f"{head}{marker}\n\n{text}\n\n{marker}{tail}")
    return 1 if wrong_runs else 0


if __name__ == "__main__":
    sys.exit(main())
