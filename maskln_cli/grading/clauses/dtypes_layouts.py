"""The clauses on dtypes, devices and memory layouts: the output has x's dtype and device
(float64 computed in float64), any strides of the inputs work, and the output's strides are
``torch.empty_like(x)``'s (strict).
"""

from __future__ import annotations

import itertools

import torch

from maskln_cli.grading.clauses import draws, families
from maskln_cli.grading.clauses.assumed import dtype_allowed
from maskln_cli.grading.clauses.calls import Call, ClauseRun, one_call_each
from maskln_cli.grading.clauses.cases import (
    Case,
    apply_view,
    describe_inputs,
    dtype_name,
    make_case,
)
from maskln_cli.grading.clauses.clause import each_call_judge, make_clause
from maskln_cli.grading.clauses.judging import (
    Verdict,
    diagnose_failures,
    relative_rms_error,
    value_mismatch,
)
from maskln_cli.grading.exercise import current

# dtypes -------------------------------------------------------------------------------------------


def _dtypes_cases(seed: int) -> list[Case]:
    g = draws.generator(seed, "dtypes")
    cases = []
    for dtype in (torch.float32, torch.float64):
        # Wide rows (std 1e4): eps is negligible, so only the precision of the arithmetic
        # shows: float32 arithmetic errs by ~1e-7, float64 by ~1e-15.
        x = draws.rows(g, (3, 5), 24, spreads=(1e4, 3e3), offset=1.0)
        label = describe_inputs(x, dtype, 1e-5, "rows of std 1e4")
        cases.append(
            make_case(
                label,
                x,
                draws.mask(g, (3, 5)),
                draws.params(g, 24),
                1e-5,
                dtype,
                family=families.WIDE,
            )
        )
    cases += families.family_cases(g, (3, 5), families=(families.ONE_CHANNEL, families.PRIME))
    return cases


def same_device(reported: object, expected: str) -> bool:
    """Whether a tensor's reported device (a string) is ``expected``: of the same type, and of
    the same index (an index left out is 0; every CPU index is the one CPU).

    Example:
        >>> same_device("cpu", "cpu"), same_device("cuda:1", "cuda:0")
        (True, False)
    """
    try:
        got, want = torch.device(str(reported)), torch.device(expected)
    except (RuntimeError, TypeError):
        return False
    if got.type != want.type:
        return False
    return got.type == "cpu" or (got.index or 0) == (want.index or 0)


def _dtype_verdict(case: Case, call: Call, run: ClauseRun) -> Verdict | None:
    out = run.tensor(call.key, "out")
    expected = dtype_name(case.x.dtype)
    if not dtype_allowed(out.dtype, case.x.dtype):
        detail = f"{case.label}: returned {dtype_name(out.dtype)}, not {expected}"
        return Verdict(False, detail, diagnose_failures([(case, out)]))
    got_device = run.meta.get(call.key, {}).get("device")
    if not same_device(got_device, run.device):
        return Verdict(
            False, f"{case.label}: returned a tensor on {got_device}, not on {run.device}"
        )
    if case.x.dtype == torch.float64:
        problem = _precision_problem(out, case.reference())
        if problem is not None:
            return Verdict(False, f"{case.label}: {problem}", diagnose_failures([(case, out)]))
    return None


FLOAT32_ROUNDING = (1e-8, 1e-5)
"""Relative RMS errors of float64 rows computed in float32 (about 6e-8 on the dtypes rows);
a wrong formula errs more (an unbiased variance: 1.5e-2), eps misplaced less (3e-9)."""


HALF_ROUNDING = 3e-2
"""The largest relative RMS error a half precision's rounding makes (bfloat16's unit roundoff
is 3.9e-3; a float64 kernel rounding xhat to bfloat16 erred by 1.3e-3, and was told 'not a
precision's rounding')."""


def _precision_problem(out: torch.Tensor, reference: torch.Tensor) -> str | None:
    """What is wrong with a float64 output that should be float64-accurate: a lower
    precision only when its error is the size of float32's rounding; else wrong values, or a
    shape that cannot be judged."""
    if tuple(out.shape) != tuple(reference.shape):
        return (
            f"returned shape {list(out.shape)} for x {list(reference.shape)}: its precision"
            " cannot be judged (leading_axes and values judge shapes)"
        )
    mismatch = value_mismatch(out, reference, torch.float64)
    if mismatch is None:
        return None
    error = relative_rms_error(out, reference)
    low, high = FLOAT32_ROUNDING
    if low <= error <= high:
        return (
            f"relative RMS error {error:.2g}, the size of float32's rounding, where float64's is"
            f" ~1e-16: {mismatch}"
        )
    if high < error <= HALF_ROUNDING:
        return (
            f"{mismatch} (relative RMS error {error:.2g}: more than float32's rounding, as much"
            " as a half precision's, or wrong values; the values clause shows more)"
        )
    return (
        f"{mismatch} (relative RMS error {error:.2g}: not a precision's rounding, the values"
        " are wrong; the values clause shows more)"
    )


DTYPES = make_clause(
    "dtypes",
    "required",
    "the output has x's dtype and device; float64 is computed in float64 (C = 1 and a prime C too)",
    _dtypes_cases,
    calls=one_call_each,
    judge=each_call_judge(_dtype_verdict),
)


# strided_inputs -----------------------------------------------------------------------------------


def _strided_cases(seed: int) -> list[Case]:
    g = draws.generator(seed, "strided_inputs")
    b, n, c = 3, 4, 6
    layouts = [
        ("x permuted", (n, b, c), (("permute", (1, 0, 2)),)),
        ("x a stepped slice", (b, 2 * n, 2 * c), (("step", 1, 2), ("step", 2, 2))),
        ("x expanded (stride 0)", (b, 1, c), (("expand", (b, n, c)),)),
        ("x channels-strided", (b, c, n), (("permute", (0, 2, 1)),)),
    ]
    cases = []
    shapes = [
        (families.LAYOUT, what, base_shape, x_views, dtype, c)
        for (what, base_shape, x_views), dtype in itertools.product(
            layouts, (torch.float64, torch.float32)
        )
    ]
    shapes += [
        (
            families.ONE_CHANNEL,
            "x permuted",
            (n, b, 1),
            (("permute", (1, 0, 2)),),
            torch.float32,
            1,
        ),
        (
            families.PRIME,
            "x channels-strided",
            (b, 7, n),
            (("permute", (0, 2, 1)),),
            torch.float64,
            7,
        ),
    ]
    for family, what, base_shape, x_views, dtype, c in shapes:
        x = draws.rows(g, base_shape[:-1], base_shape[-1])
        valid_base = draws.mask(g, (n, b))  # transposed below: non-contiguous
        scale, bias = draws.params(g, 2 * c)  # every second element below: non-contiguous
        eps = families.eps_for(family, dtype)
        parameters = current().bias_words("scale and bias", "scale")
        label = (
            f"x [{b}, {n}, {c}] {dtype_name(dtype)}, eps {eps:g}, {what};"
            f" valid, {parameters} non-contiguous"
        )
        case = make_case(label, x, valid_base, (scale, bias), eps, dtype, family=family)
        case.views = {
            "x": x_views,
            "valid": (("permute", (1, 0)),),
            "scale": (("step", 0, 2),),
            "bias": (("step", 0, 2),),
        }
        cases.append(case)
    return cases


STRIDED_INPUTS = make_clause(
    "strided_inputs",
    "required",
    "permuted, stepped-slice, expanded and channels-strided x; non-contiguous valid,"
    " scale and bias; C = 1 and a prime C too",
    _strided_cases,
    calls=one_call_each,
)


# output_layout ------------------------------------------------------------------------------------


def _layout_cases(seed: int) -> list[Case]:
    g = draws.generator(seed, "output_layout")
    layouts = [
        ("x permuted", (5, 3, 6), (("permute", (1, 0, 2)),)),
        ("x permuted", (4, 3, 5, 6), (("permute", (2, 0, 1, 3)),)),
        ("x channels-strided", (3, 6, 5), (("permute", (0, 2, 1)),)),
        ("x channels-last", (2, 6, 3, 4), (("permute", (0, 2, 3, 1)),)),
        ("x channels-last, a prime C", (2, 7, 3, 4), (("permute", (0, 2, 3, 1)),)),
        ("x permuted, C = 1", (5, 3, 1), (("permute", (1, 0, 2)),)),
    ]
    cases = []
    for what, base_shape, views in layouts:
        x = draws.rows(g, base_shape[:-1], base_shape[-1])
        logical = apply_view(x, views[0])
        channels = logical.shape[-1]
        dtype = torch.float32
        label = describe_inputs(logical, dtype, 1e-5, f"{what}, strides {list(logical.stride())}")
        case = make_case(
            label,
            x,
            draws.mask(g, logical.shape[:-1]),
            draws.params(g, channels),
            1e-5,
            dtype,
            family=families.LAYOUT,
        )
        case.views = {"x": views}
        cases.append(case)
    return cases


def _layout_verdict(case: Case, call: Call, run: ClauseRun) -> Verdict | None:
    x = case.inputs()["x"]
    expected = list(torch.empty_like(x).stride())
    meta = run.meta.get(call.key, {})
    if meta.get("shape") != list(x.shape):
        return Verdict(False, f"{case.label}: shape {meta.get('shape')}")
    if meta.get("stride") != expected:
        return Verdict(
            False,
            f"{case.label}: output strides {meta.get('stride')}, torch.empty_like(x)'s {expected}",
        )
    return None


OUTPUT_LAYOUT = make_clause(
    "output_layout",
    "strict",
    "the output's strides are torch.empty_like(x)'s",
    _layout_cases,
    calls=one_call_each,
    judge=each_call_judge(_layout_verdict),
)
