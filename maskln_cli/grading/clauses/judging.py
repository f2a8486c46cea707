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

from maskln_cli.grading.clauses.assumed import reference_formula, tolerance_dtype
from maskln_cli.grading.clauses.calls import GRAD_INPUTS, Call, ClauseRun
from maskln_cli.grading.clauses.cases import Case
from maskln_cli.grading.clauses.catalogue import correct_formula, diagnose_formulas, formulas
from maskln_cli.grading.clauses.causes import (
    GRADIENT_LOST_AT_ZERO_VARIANCE,
    NAN_AT_ZERO_VARIANCE,
    STATISTICS_DETACHED,
    UPSTREAM_READ_AS_CONTIGUOUS,
    family_cause,
)
from maskln_cli.grading.clauses.own_mistakes import gradient_pattern
from maskln_cli.grading.clauses.rows import diagnose_rows
from maskln_cli.grading.exercise import current
from maskln_cli.op.mistakes import LOWER_PRECISION, Diagnosis, diagnose_precision

VALUE_TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 4 * 2.0**-10,
    torch.bfloat16: 4 * 2.0**-7,
}
"""rtol = atol for outputs against the float64 reference, by input dtype, on well-conditioned
rows (|mean| <= 2 * std): a few hundred roundings of a correct kernel, far below what any
known mistake gives. Half precisions: 4 units in the last place at 1 (a function computing in
float16 errs by about 1.3 of them, with float32 accumulation by 0.3)."""
GRAD_TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 4 * 2.0**-10,
    torch.bfloat16: 4 * 2.0**-7,
}
"""rtol, and atol relative to the largest reference gradient, for gradients (sums over rows
and the backward's cancellations round more than the forward)."""
EXACT = 1e-12
"""The worked example's numbers are exact binary fractions: a correct kernel errs by 0."""


@dataclass
class Verdict:
    """A clause's verdict: its first counterexample in words, and the known mistakes it
    matches (None: not a failure known mistakes explain; []: none matches); ``case`` (its
    index in the clause's cases) and ``call``: the counterexample, when the judge knows it
    (a cause is confirmed by calling it again: :mod:`maskln_cli.grading.confirm`)."""

    passed: bool
    detail: str | None = None
    diagnosis: list[Diagnosis] | None = None
    case: int | None = None
    call: Call | None = None


PASSED = Verdict(True)


def format_number(value: float) -> str:
    """``-0`` stays ``-0``; NaN and inf are spelled out."""
    return f"{value:.7g}"


def format_pair(gave: float, expected: float, dtype: torch.dtype = torch.float64) -> str:
    """``gave X, the reference gives Y`` with as many significant digits (7 at least) as make
    two different numbers read differently; when they agree to 7 digits, how many units in the
    last place of ``dtype`` (the output's) they are apart.

    Example:
        >>> format_pair(-1.0396132, -1.03961302, torch.float32)
        'gave -1.0396132, the reference gives -1.039613 (1.5 float32 ulps apart)'
        >>> format_pair(-1.03961289, -1.03961291, torch.float32)[-67:]
        'gives -1.03961291 (less than 1 float32 ulp apart: float32 rounding)'
        >>> format_pair(0.5, 0.25)
        'gave 0.5, the reference gives 0.25'
    """
    gave, expected = float(gave), float(expected)
    digits = 7
    while digits < 17 and f"{gave:.{digits}g}" == f"{expected:.{digits}g}" and gave != expected:
        digits += 1
    text = f"gave {gave:.{digits}g}, the reference gives {expected:.{digits}g}"
    ulps = ulps_apart(gave, expected, dtype) if digits > 7 else None
    if ulps is not None and ulps < 10_000:
        name = str(dtype).removeprefix("torch.")
        if ulps < 1:
            text += f" (less than 1 {name} ulp apart: {name} rounding)"
        else:
            text += f" ({ulps:.2g} {name} ulps apart)" if ulps < 10 else f" ({ulps:,.0f} ulps)"
    return text


def ulps_apart(a: float, b: float, dtype: torch.dtype) -> float | None:
    """How many units in the last place of ``dtype`` (at ``b``) ``a`` and ``b`` are apart;
    None when that means nothing (not finite, zero, not a floating dtype).

    Example:
        >>> ulps_apart(1.0 + 2**-23, 1.0, torch.float32)
        1.0
    """
    if not (math.isfinite(a) and math.isfinite(b)) or b == 0 or not dtype.is_floating_point:
        return None
    info = torch.finfo(dtype)
    _, exponent = math.frexp(max(abs(b), info.tiny))
    return abs(a - b) / (info.eps * 2.0 ** (exponent - 1))


def first_mismatch(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float
) -> str | None:
    """Where ``actual`` is furthest beyond ``atol + rtol * |expected|`` (NaN is beyond
    everything but a NaN expected, as an assumed mistake's formula may give; an infinity
    matches the same infinity), in words; None when every element is within."""
    if tuple(actual.shape) != tuple(expected.shape):
        return f"shape {list(actual.shape)}, the reference's {list(expected.shape)}"
    if actual.numel() == 0:
        return None
    a, e = actual.double(), expected.double()
    allowed = atol + rtol * e.abs()
    error = (a - e).abs()
    bad = ~(error <= allowed)  # NaN compares False
    bad &= ~(a.isnan() & e.isnan()) & ~(a.isinf() & (a == e))
    if not bad.any():
        return None
    excess = torch.where(bad, (error - allowed).nan_to_num(math.inf), -math.inf)
    index = unravel(int(excess.argmax()), a.shape)
    return f"at {index} {format_pair(a[tuple(index)], e[tuple(index)], actual.dtype)}"


def unravel(flat: int, shape: torch.Size | tuple[int, ...]) -> list[int]:
    """The index of element ``flat`` of a row-major ``shape`` (``torch.unravel_index`` imports
    hundreds of modules on first use: a second of a grade).

    Example:
        >>> unravel(5, (2, 3))
        [1, 2]
    """
    index = []
    for size in reversed(tuple(shape)):
        flat, rest = divmod(flat, size)
        index.append(rest)
    return index[::-1]


def value_mismatch(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Where an output of a ``dtype`` case is beyond its tolerance (:data:`VALUE_TOLERANCE`)."""
    dtype = tolerance_dtype(dtype)
    tolerance = VALUE_TOLERANCE.get(dtype, VALUE_TOLERANCE[torch.float32])
    return first_mismatch(actual, expected, tolerance, tolerance)


def grad_mismatch(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Where a gradient of a ``dtype`` case is beyond its tolerance (:data:`GRAD_TOLERANCE`)."""
    dtype = tolerance_dtype(dtype)
    tolerance = GRAD_TOLERANCE.get(dtype, GRAD_TOLERANCE[torch.float32])
    largest = float(expected.abs().nan_to_num(0.0, 0.0, 0.0).max()) if expected.numel() else 0.0
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
    bias = leaves.get("bias", t["bias"])  # RMSNorm's reference ignores it
    out = reference_formula()(leaves["x"], t["valid"], leaves["scale"], bias, case.eps)
    assert case.grad_out is not None
    weighted = (out * t["grad_out"].double()).sum()
    grads = torch.autograd.grad(weighted, list(leaves.values()))
    found = dict(zip(leaves, grads, strict=True))
    return {f"grad_{name}": found[name] for name in requires if name in found}


def diagnose_call(
    case: Case, call: Call, run: ClauseRun, order: Sequence[Case] = ()
) -> list[Diagnosis] | None:
    """The diagnosis of a failing call from its output, when the output is wrong (a gradient
    clause's failure often comes from a wrong forward); None when it is right, or absent. On
    poisoned padding only the rows are read (formulas evaluated on NaN give NaN)."""
    out = run.tensors.get(f"{call.key}.out")
    if out is None or value_mismatch(out, case.reference(), case.x.dtype) is None:
        return None
    if case.clean_x is not None:
        if not current().patterns:  # the rows' diagnoses are LayerNorm's
            return []
        earlier = list(order[: _position(order, case)])
        by_rows = diagnose_rows(case, out, earlier)
        return [by_rows] if by_rows is not None else None
    return diagnose_failures([(case, out)], order=order)


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
    """Every call's output against the reference, and its gradients when it made them. The
    diagnosis weighs the failing outputs against the right ones of calls made alike (same
    grad mode and style): a formula wrong where the function was right is not its mistake."""
    failing: list[tuple[Case, torch.Tensor]] = []
    right: list[tuple[Case, tuple[str, bool, str]]] = []
    wrong_kinds: set[tuple[str, bool, str]] = set()
    first: str | None = None
    first_call: Call | None = None
    first_gradient: tuple[Case, Call] | None = None
    for call in calls:
        case = cases[call.case]
        kind = (call.mode, bool(call.requires), call.style)
        problem = failure_detail(case, call, run, what(call))
        if problem is None:
            dtype = case.x.dtype
            out = run.tensor(call.key, "out")
            mismatch = value_mismatch(out, case.reference(), dtype)
            if mismatch is not None:
                problem = f"{case.label}{what(call)}: {mismatch}"
                failing.append((case, out))
                wrong_kinds.add(kind)
            else:
                right.append((case, kind))
                if call.backward:
                    problem = judge_gradients(case, call, run, what(call))
                    if problem is not None and first is None:
                        first_gradient = (case, call)
        if problem is not None and first is None:
            first, first_call = problem, call
    if first is None:
        return PASSED
    at = {"case": first_call.case if first_call else None, "call": first_call}
    if not diagnose:
        return Verdict(False, first, **at)
    if not failing and first_gradient is not None:  # the outputs are right, a gradient is not
        return Verdict(False, first, gradient_causes(*first_gradient, run), **at)
    passing = list({id(c): c for c, kind in right if kind in wrong_kinds}.values())
    found = diagnose_failures(failing, passing=passing, order=cases)
    return Verdict(False, first, found, **at)


def judge_gradients(case: Case, call: Call, run: ClauseRun, what: str = "") -> str | None:
    expected = reference_gradients(case, call.requires)
    for name, reference in expected.items():
        mismatch = grad_mismatch(run.tensor(call.key, name), reference, case.x.dtype)
        if mismatch is not None:
            return f"{case.label}{what}: {name} {mismatch}"
    return None


def diagnose_failures(
    failing: list[tuple[Case, torch.Tensor]],
    limit: int = 8,
    passing: Sequence[Case] = (),
    order: Sequence[Case] = (),
) -> list[Diagnosis] | None:
    """The known mistakes that explain the most of the first ``limit`` failing cases (one
    output per case), best first; None when no output could be diagnosed (wrong shapes).
    Several wrong formulas agree on degenerate rows (C = 1, a variance of 1), so one case
    alone can be ambiguous where a few are not. A dtype mistake (an output in another dtype,
    or computed in a lower precision) comes first; formulas are then matched at that
    precision. When no formula matches, the rows say whether another mask was used or the
    invalid rows were never written (:mod:`.rows`; ``order``: the clause's cases in the order
    they were called, whose masks a cache may hold).

    ``passing``: cases on which the function was right (called as the failing ones were). A
    formula that is wrong on one of them is not what the function does: it matched the
    failures by coincidence (an unbiased variance is NaN at C = 1, as a solution wrong only
    there is), and is dropped. The formulas are the exercise's own catalogue's
    (:mod:`.catalogue`); precisions, rows and families are LayerNorm's only."""
    patterns = current().patterns
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
        found = []
        if patterns:
            found = diagnose_precision(out, t["x"], t["valid"], t["scale"], t["bias"], case.eps)
        precision = case.x.dtype
        if found:
            precision = LOWER_PRECISION.get(found[0].mistake) or out.dtype
        found += diagnose_formulas(
            out,
            t["x"],
            t["valid"],
            t["scale"],
            t["bias"],
            case.eps,
            max(precision, case.x.dtype, key=lambda d: -d.itemsize),
        )
        found = [d for d in found if not refuted(d.mistake, passing)]
        if not found and patterns:
            earlier = list(order[: _position(order, case)])
            by_rows = diagnose_rows(case, out, earlier)
            found = [by_rows] if by_rows is not None else []
        diagnosed += 1
        for diagnosis in found:
            matches.setdefault(diagnosis.mistake, []).append(diagnosis)
    shared = condition_causes([case for case, _ in failing][:limit]) if patterns else []
    if not matches:
        return shared if diagnosed else None
    most = max(len(found) for found in matches.values())
    best = [found for found in matches.values() if len(found) == most]
    best.sort(key=lambda found: sum(d.distance for d in found) / len(found))
    named = [found[0] for found in best]
    return named + [d for d in shared if d.mistake not in {n.mistake for n in named}]


def _is_prime(n: int) -> bool:
    return n >= 5 and all(n % d for d in range(2, int(n**0.5) + 1))


def conditions(case: Case) -> set[str]:
    """The families of data whose condition ``case`` meets, read from its data (a case of
    random rows with C = 1 meets C = 1's): C = 1, a prime C, constant rows, exact zeros, exact
    ties in its valid rows, a strided upstream gradient, eps below 1e-5."""
    from maskln_cli.grading.clauses import families

    found = {case.family}
    t = case.inputs(clean=case.clean_x is not None)
    channels = int(t["x"].shape[-1]) if t["x"].dim() else 1
    if channels == 1:
        found.add(families.ONE_CHANNEL)
    elif _is_prime(channels):
        found.add(families.PRIME)
    if case.eps < 1e-5:
        found.add(families.EPS)
    if "grad_out" in case.views:
        found.add(families.UPSTREAM)
    if channels > 1 and t["x"].dim() >= 1:
        rows = t["x"].double().reshape(-1, channels)[t["valid"].reshape(-1)]
        if rows.numel():
            mean = rows.sum(-1, keepdim=True) / channels
            constant = (rows == rows[:, :1]).all(-1)
            if bool(constant.any()):
                found.add(families.CONSTANT)
            if bool((rows == 0).any()):
                found.add(families.ZEROS)
            if channels > 2 and bool(((rows == mean).any(-1) & ~constant).any()):
                found.add(families.TIES)
    return found


def condition_causes(cases: Sequence[Case]) -> list[Diagnosis]:
    """The causes of the families of data whose condition every one of ``cases`` meets
    (:func:`conditions`): candidates, which a probe confirms or refutes."""
    if not cases:
        return []
    shared = set.intersection(*(conditions(case) for case in cases))
    found = []
    for family in sorted(shared):
        cause = family_cause({family}, {min(c.eps for c in cases)})
        if cause is not None:
            found.append(cause)
    return found


def _position(order: Sequence[Case], case: Case) -> int:
    return next((i for i, each in enumerate(order) if each is case), 0)


REFUTING_CASES = 24
"""How many passing cases a formula is tried on before it is kept."""


def refuted(mistake: str, passing: Sequence[Case]) -> bool:
    """Whether the formula of ``mistake`` is wrong on a case the function got right (beyond
    that case's tolerance): then the function does not make that mistake.

    Where the formula is undefined (NaN on a row of finite values: an unbiased variance at
    C = 1) it says nothing: a solution that guards it (``max(C - 1, 1)``) makes the same mistake."""
    formula = formulas().get(mistake)
    if formula is None:
        return False
    for case in list(passing)[:REFUTING_CASES]:
        t = case.inputs()
        if not t["x"].numel():
            continue
        args = (t["x"].double(), t["valid"], t["scale"].double(), t["bias"].double(), case.eps)
        with torch.no_grad():
            wrong, right = formula.formula(*args), correct_formula()(*args)
        if wrong.shape == right.shape:  # a row's output is its own row's: finite rows' NaN
            finite_rows = t["x"].isfinite().all(dim=-1, keepdim=True)
            wrong = torch.where(wrong.isnan() & finite_rows, right, wrong)
        if first_mismatch(wrong, right, *_tolerances(case.x.dtype)) is not None:
            return True
    return False


def _tolerances(dtype: torch.dtype) -> tuple[float, float]:
    tolerance = VALUE_TOLERANCE.get(dtype, VALUE_TOLERANCE[torch.float32])
    return tolerance, tolerance


def _detached_statistics(detach_mean: bool, detach_var: bool):
    """The op with its mean and/or variance cut from the graph: right values, other
    gradients."""

    def formula(x, valid, scale, bias, eps):
        keep = valid.unsqueeze(-1)
        clean = torch.where(keep, x, 0.0)
        mean = clean.mean(-1, keepdim=True)
        mean = mean.detach() if detach_mean else mean
        var = (clean - mean).square().mean(-1, keepdim=True)
        var = var.detach() if detach_var else var
        return torch.where(keep, (clean - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)

    return formula


GRADIENT_MATCH = {torch.float64: 1e-7, torch.float32: 1e-3}
"""How close a gradient must be to a mistake's to match it (relative L2), by dtype."""


def gradient_causes(case: Case, call: Call, run: ClauseRun) -> list[Diagnosis] | None:
    """Why a call's gradients are wrong when its output is right: NaN, or a gradient of 0,
    on rows of zero variance; the upstream gradient read as contiguous (a case whose upstream
    gradient is strided); statistics cut from the graph. None: no known cause."""
    if not current().patterns:  # zero-variance rows, patterns and probes are LayerNorm's
        return None
    pattern = _gradient_pattern(case, call, run)
    if "x" not in call.requires or f"{call.key}.grad_x" not in run.tensors:
        return [pattern] if pattern is not None else None
    t = case.inputs()
    actual = run.tensors[f"{call.key}.grad_x"].double()
    reference = reference_gradients(case, ("x",))["grad_x"]
    if tuple(actual.shape) != tuple(reference.shape):
        return None
    x = torch.where(t["valid"][..., None], t["x"].double(), 0.0)
    flat = (x == x[..., :1]).all(-1) & t["valid"]  # valid rows of zero variance
    rows = flat[..., None].expand(x.shape)
    leaked = ~actual.isfinite() & reference.isfinite()
    if bool((leaked & rows).any()):
        return [NAN_AT_ZERO_VARIANCE.diagnosis()]
    lost = rows & (actual == 0) & (reference.abs() > 0)
    if bool(lost.any()) and bool((actual[rows] == 0).all()):
        return [GRADIENT_LOST_AT_ZERO_VARIANCE.diagnosis()]
    if pattern is not None:
        return [pattern]
    if "grad_out" in case.views:
        return [UPSTREAM_READ_AS_CONTIGUOUS.diagnosis()]
    found = detached_match(case, actual, reference)
    return found + condition_causes([case]) or None


def _gradient_pattern(case: Case, call: Call, run: ClauseRun) -> Diagnosis | None:
    """A cause the wrong gradients show themselves (:func:`.own_mistakes.gradient_pattern`),
    the first one of x's, scale's and bias's."""
    out = run.tensors.get(f"{call.key}.out")
    right = out is not None and value_mismatch(out, case.reference(), case.x.dtype) is None
    t = case.inputs()
    expected = reference_gradients(case, call.requires)
    for name in call.requires:
        actual = run.tensors.get(f"{call.key}.grad_{name}")
        if actual is None:
            continue
        found = gradient_pattern(f"grad_{name}", actual, expected[f"grad_{name}"], t["valid"],
                                 t.get("grad_out"), right, case.x.dtype)  # fmt: skip
        if found is not None:
            return found
    return None


def detached_match(case: Case, actual: torch.Tensor, reference: torch.Tensor) -> list[Diagnosis]:
    t = case.inputs()
    to_truth = relative_rms_error(actual, reference)
    limit = GRADIENT_MATCH.get(case.x.dtype, GRADIENT_MATCH[torch.float32])
    found = []
    for name, description, fix, (mean, var) in STATISTICS_DETACHED:
        leaf = t["x"].detach().double().requires_grad_()
        with torch.enable_grad():
            out = _detached_statistics(mean, var)(
                leaf, t["valid"], t["scale"].double(), t["bias"].double(), case.eps
            )
            (grad,) = torch.autograd.grad((out * t["grad_out"].double()).sum(), leaf)
        distance = relative_rms_error(actual, grad)
        if distance <= limit and 10 * distance <= to_truth:
            found.append(Diagnosis(name, description, fix, distance))
    return sorted(found, key=lambda d: d.distance)[:1]
