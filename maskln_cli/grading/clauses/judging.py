"""Judging what came back: outputs and gradients against the float64 reference, within
tolerances by dtype, the first counterexample in words (:class:`Verdict`), and the known mistakes
that explain a failure (:func:`diagnose_failures`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from maskln_cli.grading.clauses.calls import GRAD_INPUTS, Call, ClauseRun
from maskln_cli.grading.clauses.cases import Case
from maskln_cli.op.mistakes import Diagnosis, diagnose_output
from maskln_cli.op.reference import reference_masked_layer_norm

VALUE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}
"""rtol = atol for outputs against the float64 reference, by input dtype, on well-conditioned
rows (|mean| <= 2 * std): a few hundred roundings of a correct kernel, far below what any
known mistake gives."""
GRAD_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
"""rtol, and atol relative to the largest reference gradient, for gradients (sums over rows
and the backward's cancellations round more than the forward)."""
EXACT = 1e-12
"""The worked example's numbers are exact binary fractions: a correct kernel errs by 0."""


@dataclass
class Verdict:
    """A clause's verdict: its first counterexample in words, and the known mistakes it
    matches (None: not a failure known mistakes explain; []: none matches)."""

    passed: bool
    detail: str | None = None
    diagnosis: list[Diagnosis] | None = None


PASSED = Verdict(True)


def format_number(value: float) -> str:
    """``-0`` stays ``-0``; NaN and inf are spelled out."""
    return f"{value:.7g}"


def first_mismatch(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float
) -> str | None:
    """Where ``actual`` is furthest beyond ``atol + rtol * |expected|`` (NaN is beyond
    everything), in words; None when every element is within."""
    if tuple(actual.shape) != tuple(expected.shape):
        return f"shape {list(actual.shape)}, the reference's {list(expected.shape)}"
    if actual.numel() == 0:
        return None
    a, e = actual.double(), expected.double()
    allowed = atol + rtol * e.abs()
    error = (a - e).abs()
    bad = ~(error <= allowed)  # NaN compares False
    if not bad.any():
        return None
    excess = torch.where(bad, (error - allowed).nan_to_num(math.inf), -math.inf)
    index = [int(i) for i in torch.unravel_index(excess.argmax(), a.shape)]
    gave, expected = format_number(a[tuple(index)]), format_number(e[tuple(index)])
    return f"at {index} gave {gave}, the reference gives {expected}"


def value_mismatch(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> str | None:
    tolerance = VALUE_TOLERANCE.get(dtype, VALUE_TOLERANCE[torch.float32])
    return first_mismatch(actual, expected, tolerance, tolerance)


def grad_mismatch(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> str | None:
    tolerance = GRAD_TOLERANCE.get(dtype, GRAD_TOLERANCE[torch.float32])
    largest = float(expected.abs().max()) if expected.numel() else 0.0
    return first_mismatch(actual, expected, tolerance, tolerance * max(1.0, largest))


def relative_rms_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """``||actual - reference|| / ||reference||`` over every element (NaN or inf: inf).

    Example:
        >>> relative_rms_error(torch.tensor([3.0, 4.5]), torch.tensor([3.0, 4.0]))
        0.1
    """
    error = (actual.double() - reference).nan_to_num(math.inf, math.inf, math.inf)
    size = float(reference.norm())
    return float(error.norm()) / size if size > 0 else float(error.norm() > 0) * math.inf


def reference_gradients(case: Case, requires: Sequence[str] = GRAD_INPUTS) -> dict[str, Any]:
    """Gradients of ``sum(reference * grad_out)`` by autograd through the float64 reference."""
    t = case.inputs()
    leaves = {name: t[name].detach().double().requires_grad_() for name in GRAD_INPUTS}
    out = reference_masked_layer_norm(
        leaves["x"], t["valid"], leaves["scale"], leaves["bias"], case.eps
    )
    assert case.grad_out is not None
    weighted = (out * case.grad_out.double()).sum()
    grads = torch.autograd.grad(weighted, list(leaves.values()))
    found = dict(zip(GRAD_INPUTS, grads, strict=True))
    return {f"grad_{name}": found[name] for name in requires}


def failure_detail(case: Case, call: Call, run: ClauseRun, what: str = "") -> str | None:
    """The error of a call, in words, or None when it ran."""
    if call.key in run.errors:
        return f"{case.label}{what}: {run.errors[call.key]}"
    return None


def judge_outputs(
    cases: list[Case],
    run: ClauseRun,
    calls: Iterable[Call],
    diagnose: bool = False,
    what: Callable[[Call], str] = lambda call: "",
) -> Verdict:
    """Every call's output against the reference, and its gradients when it made them."""
    failing: list[tuple[Case, torch.Tensor]] = []
    first: str | None = None
    for call in calls:
        case = cases[call.case]
        problem = failure_detail(case, call, run, what(call))
        if problem is None:
            dtype = case.x.dtype
            out = run.tensor(call.key, "out")
            mismatch = value_mismatch(out, case.reference(), dtype)
            if mismatch is not None:
                problem = f"{case.label}{what(call)}: {mismatch}"
                failing.append((case, out))
            elif call.backward:
                problem = judge_gradients(case, call, run, what(call))
        if problem is not None and first is None:
            first = problem
    if first is None:
        return PASSED
    return Verdict(False, first, diagnose_failures(failing) if diagnose else None)


def judge_gradients(case: Case, call: Call, run: ClauseRun, what: str = "") -> str | None:
    expected = reference_gradients(case, call.requires)
    for name, reference in expected.items():
        mismatch = grad_mismatch(run.tensor(call.key, name), reference, case.x.dtype)
        if mismatch is not None:
            return f"{case.label}{what}: {name} {mismatch}"
    return None


def diagnose_failures(
    failing: list[tuple[Case, torch.Tensor]], limit: int = 8
) -> list[Diagnosis] | None:
    """The known mistakes that explain the most of the first ``limit`` failing cases (one
    output per case), best first; None when no output could be diagnosed (wrong shapes).
    Several wrong formulas agree on degenerate rows (C = 1, a variance of 1), so one case
    alone can be ambiguous where a few are not."""
    matches: dict[str, list[Diagnosis]] = {}
    seen: set[int] = set()
    diagnosed = 0
    for case, out in failing:
        if id(case) in seen or len(seen) >= limit:
            continue
        seen.add(id(case))
        t = case.inputs()
        if tuple(out.shape) != tuple(t["x"].shape):
            continue
        found = diagnose_output(
            out, t["x"], t["valid"], t["scale"], t["bias"], case.eps, case.x.dtype
        )
        diagnosed += 1
        for diagnosis in found:
            matches.setdefault(diagnosis.mistake, []).append(diagnosis)
    if not matches:
        return [] if diagnosed else None
    most = max(len(found) for found in matches.values())
    best = [found for found in matches.values() if len(found) == most]
    best.sort(key=lambda found: sum(d.distance for d in found) / len(found))
    return [found[0] for found in best]
