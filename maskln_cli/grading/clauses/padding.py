"""The clauses on the mask and the padding: any number of leading axes (a 0-d valid too),
invalid rows exactly zero (+0.0 for the strict clause), and NaN, inf and 1e30 in invalid rows of
x changing neither the output nor any gradient, in every shape family the first two try (a 0-d
valid, one row, every row invalid or valid, zero-size) and in every grad mode.
"""

from __future__ import annotations

import itertools
import math

import torch

from maskln_cli.grading.clauses import draws, families
from maskln_cli.grading.clauses.calls import (
    GRAD_INPUTS,
    MODE_WORDS,
    Call,
    ClauseRun,
    one_call_each,
    requiring_grad_words,
)
from maskln_cli.grading.clauses.cases import Case, describe_inputs, make_case
from maskln_cli.grading.clauses.causes import NAN_AT_ZERO_VARIANCE
from maskln_cli.grading.clauses.clause import each_call_judge, make_clause
from maskln_cli.grading.clauses.judging import (
    PASSED,
    Verdict,
    diagnose_call,
    diagnose_failures,
    failure_detail,
    format_pair,
    gradient_causes,
    judge_gradients,
    reference_gradients,
    value_mismatch,
)
from maskln_cli.grading.clauses.own_mistakes import NAN_MADE_IN_PADDING
from maskln_cli.grading.clauses.rows import (
    UNINITIALIZED,
    diagnose_rows,
    sign_of_multiplied_zeros,
)
from maskln_cli.grading.exercise import current
from maskln_cli.op.mistakes import NEGATIVE_ZERO, Diagnosis, diagnose_nan_gradient

NEGATIVE_ZERO_UNBIASED = (
    "invalid rows zeroed by multiplying by the mask: a negative value * 0 is -0.0"
)
""":data:`NEGATIVE_ZERO`'s description for an exercise without a bias (RMSNorm's)."""

# leading_axes -------------------------------------------------------------------------------------

LEADING_SHAPES = ((), (5,), (2, 5), (2, 3, 2, 2), (0,), (3, 0), (0, 4))


def _leading_cases(seed: int) -> list[Case]:
    g = draws.generator(seed, "leading_axes")
    cases = []
    for i, leading in enumerate(LEADING_SHAPES):
        dtype = torch.float32 if i % 2 else torch.float64
        empty = torch.zeros(*leading, 6, dtype=torch.float64)
        x = draws.rows(g, leading, 6) if math.prod(leading) else empty
        valid = draws.mask(g, leading) if leading else torch.tensor(True)
        valid_shape = "a 0-d valid" if not leading else f"valid {list(leading)}"
        label = f"{describe_inputs(x, dtype, 1e-5)}, {valid_shape}"
        cases.append(make_case(label, x, valid, draws.params(g, 6), 1e-5, dtype, g, grad=True))
    for family, leading, channels, dtype in LEADING_FAMILIES:
        x = draws.rows(g, leading, channels)
        valid = draws.mask(g, leading) if leading else torch.tensor(True)
        valid_shape = "a 0-d valid" if not leading else f"valid {list(leading)}"
        eps = families.eps_for(family, dtype)
        label = f"{describe_inputs(x, dtype, eps)}, {valid_shape}"
        params = draws.params(g, channels)
        cases.append(make_case(label, x, valid, params, eps, dtype, g, grad=True, family=family))
    return cases


LEADING_FAMILIES = (
    (families.ONE_CHANNEL, (), 1, torch.float64),
    (families.ONE_CHANNEL, (2, 3, 2), 1, torch.float32),
    (families.PRIME, (2, 3, 2, 2), 7, torch.float64),
    (families.PRIME, (), 13, torch.float32),
)
"""(family, leading shape, C, dtype) of the cases besides random rows: C = 1 and a prime C,
with a 0-d valid and with several leading axes."""


def _leading_calls(cases: list[Case]) -> list[Call]:
    return [
        Call(str(i), i, requires=GRAD_INPUTS, backward=True)
        if case.x.numel()
        else Call(str(i), i)  # zero-size: the output's shape and dtype
        for i, case in enumerate(cases)
    ]


LEADING_AXES = make_clause(
    "leading_axes",
    "required",
    "0, 1, 2 and 4 leading axes (x [C] with a 0-d valid), and zero-size inputs,"
    " values and gradients; C = 1 and a prime C among them",
    _leading_cases,
    calls=_leading_calls,
)


# invalid_rows_zero --------------------------------------------------------------------------------


def _invalid_cases(seed: int) -> list[Case]:
    g = draws.generator(seed, "invalid_rows_zero")
    nonzero = current().bias_words(", bias nonzero")  # RMSNorm's padding has no bias to be
    cases = []
    masks = {
        "trailing padding": torch.arange(6)[None, :] < torch.tensor([4, 1])[:, None],
        "leading padding": torch.arange(6)[None, :] >= torch.tensor([2, 5])[:, None],
        "interleaved padding": draws.mask(g, (2, 6)),
        "every row invalid": torch.zeros(2, 6, dtype=torch.bool),
    }
    for dtype in (torch.float64, torch.float32):
        for what, valid in masks.items():
            x = draws.rows(g, (2, 6), 8)
            label = f"{describe_inputs(x, dtype, 1e-5)}, {what}{nonzero}"
            cases.append(make_case(label, x, valid, draws.params(g, 8), 1e-5, dtype))
    x = torch.zeros(2, 6, 8, dtype=torch.float64)
    label = f"{describe_inputs(x, torch.float32, 1e-5)}, zero padding{nonzero}"
    cases.append(
        make_case(label, x, masks["trailing padding"], draws.params(g, 8), 1e-5, torch.float32)
    )
    x = draws.rows(g, (), 8)
    label = f"{describe_inputs(x, torch.float64, 1e-5)}, a 0-d valid False{nonzero}"
    cases.append(make_case(label, x, torch.tensor(False), draws.params(g, 8), 1e-5, torch.float64))
    cases += families.family_cases(g, (2, 6))
    return cases


def _invalid_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    failing = []
    first = None
    for call in one_call_each(cases):
        case = cases[call.case]
        problem = failure_detail(case, call, run)
        if problem is None:
            out = run.tensor(call.key, "out")
            problem = _nonzero_invalid(out, case)
            if problem is not None:
                failing.append((case, out))
        first = first or problem
    if first is None:
        return PASSED
    return Verdict(False, first, diagnose_failures(failing))


def _nonzero_invalid(out: torch.Tensor, case: Case, what: str = "") -> str | None:
    """Where ``out`` is not the reference's 0 in an invalid row (-0.0 is 0 here; a mistake's
    formula, when one is assumed, may give other values there)."""
    invalid = case.invalid()
    if out.shape != invalid.shape:
        return f"{case.label}{what}: shape {list(out.shape)}, the reference's {list(invalid.shape)}"
    expected = case.reference()
    same = (out.double() == expected) | (out.isnan() & expected.isnan())  # NaN != 0 too
    wrong = invalid & ~same
    if not wrong.any():
        return None
    index = tuple(int(i) for i in wrong.nonzero()[0])
    pair = format_pair(out[index], expected[index], out.dtype)
    return f"{case.label}{what}: at {list(index)} (an invalid row) {pair}"


INVALID_ROWS_ZERO = make_clause(
    "invalid_rows_zero",
    "required",
    "invalid rows are zero although bias is not; constant rows, exact zeros, C = 1 and a"
    " prime C too",
    _invalid_cases,
    calls=one_call_each,
    judge=_invalid_judge,
)


# sanitized_padding --------------------------------------------------------------------------------

POISON_LABEL = "NaN, ±inf and 1e30 in invalid rows"
_POISON = (math.nan, math.inf, -math.inf, 1e30)


def _poison(x: torch.Tensor, valid: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """x with NaN, +inf, -inf and 1e30 in its invalid rows: whole rows of each, and mixes (a
    lone invalid row mixes all four)."""
    poison = torch.tensor(_POISON, dtype=x.dtype)
    pick = torch.randint(0, len(_POISON), x.shape, generator=g)
    rows = torch.randint(0, 2 * len(_POISON), x.shape[:-1], generator=g)
    if rows.numel() == 1:
        rows.fill_(len(_POISON))  # mixed
        pick = torch.arange(x.shape[-1]).remainder(len(_POISON)).expand(x.shape)
    whole = rows < len(_POISON)  # half the rows hold one poison throughout
    pick = torch.where(whole[..., None], rows[..., None].clamp_max(len(_POISON) - 1), pick)
    return torch.where(valid[..., None], x, poison[pick])


# The shape families of leading_axes and invalid_rows_zero: (what, leading shape, mask, dtype).
_FAMILIES = (
    ("a 0-d valid False", (), "none", torch.float64),
    ("a 0-d valid True", (), "all", torch.float32),
    ("one row, invalid", (1,), "none", torch.float32),
    ("one row, valid", (1,), "all", torch.float64),
    ("every row invalid", (2, 6), "none", torch.float32),
    ("every row invalid", (2, 6), "none", torch.float64),
    ("every row valid", (2, 6), "all", torch.float32),
    ("zero-size", (0,), "none", torch.float32),
    ("zero-size", (3, 0), "none", torch.float64),
)


_DATA_FAMILIES = (
    (families.CONSTANT, torch.float64, 8),
    (families.ZEROS, torch.float32, 8),
    (families.ONE_CHANNEL, torch.float64, 1),
    (families.ONE_CHANNEL, torch.float32, 1),
    (families.PRIME, torch.float32, 13),
)
"""(family, dtype, C) of the poisoned cases drawn from the data families."""


def _poisoned_cases(seed: int, clause: str, grad: bool) -> list[Case]:
    """Random masks of [3, 6] rows, the shape families (:data:`_FAMILIES`) and the data
    families (:data:`_DATA_FAMILIES`), with NaN, ±inf and 1e30 in every invalid row; a 0-d
    valid False with 1e30 throughout too (its square overflows float32)."""
    g = draws.generator(seed, clause)
    cases = []
    shapes = [
        (families.POISONED, "", (3, 6), "random", dtype, channels)
        for dtype, channels in itertools.product((torch.float64, torch.float32), (8, 3))
    ]
    shapes += [
        (families.POISONED, f", {what}", leading, kind, dtype, 8)
        for what, leading, kind, dtype in _FAMILIES
    ]
    shapes += [
        (family, "", (3, 6), "random", dtype, channels)
        for family, dtype, channels in _DATA_FAMILIES
    ]
    for family, what, leading, kind, dtype, channels in shapes:
        if family == families.CONSTANT:
            x = families.constant_rows(g, leading, channels)
        elif family == families.ZEROS:
            x = families.zero_holding_rows(g, leading, channels)
        else:
            x = draws.rows(g, leading, channels)
        if kind == "random":
            valid = families.mask_for(family, x, g, leading)
        else:
            valid = torch.full(leading, kind == "all", dtype=torch.bool)
        eps = families.eps_for(family, dtype)
        label = f"{describe_inputs(x, dtype, eps)}{what}, {POISON_LABEL}"
        case = make_case(
            label, x, valid, draws.params(g, channels), eps, dtype, g, grad=grad, family=family
        )
        case.clean_x = case.x
        case.x = _poison(case.x, valid, g)
        cases.append(case)
    x = draws.rows(g, (), 8)
    label = f"{describe_inputs(x, torch.float32, 1e-5)}, a 0-d valid False, 1e30 throughout"
    params = draws.params(g, 8)
    case = make_case(
        label,
        x,
        torch.tensor(False),
        params,
        1e-5,
        torch.float32,
        g,
        grad,
        family=families.POISONED,
    )
    case.clean_x = case.x
    case.x = torch.full_like(case.x, 1e30)
    cases.append(case)
    return cases


_PADDING_MODES = (
    ("", Call("", 0)),
    (".grad", Call("", 0, requires=GRAD_INPUTS)),
    (".no_grad", Call("", 0, requires=GRAD_INPUTS, mode="no_grad")),
    (".inference", Call("", 0, requires=GRAD_INPUTS, mode="inference")),
)
"""Each poisoned case is called with no input requiring grad, with x, scale and bias requiring
grad, and with them requiring grad under torch.no_grad() and torch.inference_mode()."""


def _sanitized_padding_calls(cases: list[Case]) -> list[Call]:
    calls = []
    for i in range(len(cases)):
        calls += [
            Call(f"{i}{suffix}", i, requires=call.requires, mode=call.mode)
            for suffix, call in _PADDING_MODES
        ]
        calls.append(Call(f"{i}.clean", i, clean=True))
    return calls


def _mode_words(call: Call) -> str:
    if call.mode != "grad":
        return f", {MODE_WORDS[call.mode]}"
    return requiring_grad_words() if call.requires else ""


def _sanitized_padding_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    for i, case in enumerate(cases):
        clean = run.tensors.get(f"{i}.clean.out")
        reference = case.reference()
        t = case.inputs()
        for suffix, mode in _PADDING_MODES:
            call = Call(f"{i}{suffix}", i, requires=mode.requires, mode=mode.mode)
            what = _mode_words(call)
            problem = failure_detail(case, call, run, what)
            if problem is not None:
                return Verdict(False, problem)
            out = run.tensor(call.key, "out")
            nonfinite = _nonfinite(out, reference, case.invalid())
            if nonfinite is not None:
                detail = f"{case.label}{what}: {nonfinite}"
                # A mask not this call's, or rows never written, before the padding's NaN (no
                # formula: evaluated on the poisoned x, many give NaN there too).
                by_rows = diagnose_rows(case, out, cases[:i])
                found = [by_rows] if by_rows is not None else []
                if not found:
                    diagnosis = _nan_diagnosis("the output", out, clean, reference, t)
                    found = [diagnosis] if diagnosis else []
                return Verdict(False, detail, found)
            problem = _nonzero_invalid(out, case, what) or _prefixed(
                case, value_mismatch(out, reference, case.x.dtype), what
            )
            if problem is None and clean is not None and clean.shape == out.shape:
                # valid rows only: the clean call's own invalid rows are judged in that call
                keep = ~case.invalid()
                mismatch = value_mismatch(
                    torch.where(keep, out.double(), 0.0),
                    torch.where(keep, clean.double(), 0.0),
                    case.x.dtype,
                )
                if mismatch is not None:
                    mismatch = mismatch.replace("the reference", "clean padding")
                    problem = f"{case.label}{what}: {mismatch}"
            if problem is not None:
                return Verdict(False, problem, _known_mistakes(case, out, cases))
    return PASSED


def _known_mistakes(case: Case, out: torch.Tensor, order: list[Case]) -> list[Diagnosis]:
    """The known mistakes a wrong output matches (formulas, another mask, rows never
    written), or none."""
    return diagnose_failures([(case, out)], order=order) or []


def _nan_diagnosis(
    name: str,
    actual: torch.Tensor,
    clean: torch.Tensor | None,
    reference: torch.Tensor,
    t: dict[str, torch.Tensor],
) -> Diagnosis | None:
    """Why ``actual`` (the output, or gradient ``name``) holds NaN or inf where the reference is
    finite: the padding's NaN only when the same call with clean padding (``clean``) is finite
    at those places; when it is not finite there either, a division by zero (None: no clean
    result to tell)."""
    leaked = ~actual.isfinite() & reference.isfinite()
    if clean is None or tuple(clean.shape) != tuple(actual.shape):
        return None
    if tuple(actual.shape) == tuple(t["x"].shape):
        keep = t["valid"][..., None]
        x = torch.where(keep, t["x"], 0.0)
        flat = ((x == x[..., :1]).all(-1, keepdim=True) & keep).expand(x.shape)
        if (leaked & flat).any():  # in a valid row of zero variance: not the padding's
            return NAN_AT_ZERO_VARIANCE.diagnosis()
    if (leaked & ~clean.isfinite()).any():
        return Diagnosis(
            NAN_WITHOUT_PADDING,
            f"NaN or inf in {name} with clean padding too, so not from the padding: a division"
            " by zero, such as an invalid row (all zeros once sanitized, variance 0) divided by"
            " its standard deviation with eps missing, (x - mean) / sqrt(var)",
            "add eps inside the square root, (x - mean) / sqrt(var + eps), and divide by nothing"
            " that can be zero (torch.where hides such a NaN in the output, not in gradients)",
            0.0,
        )
    return diagnose_nan_gradient(name, actual, reference, t["x"], t["valid"], t.get("grad_out"))


NAN_WITHOUT_PADDING = "nan_without_padding"


def _prefixed(case: Case, mismatch: str | None, what: str = "") -> str | None:
    return None if mismatch is None else f"{case.label}{what}: {mismatch}"


def _nonfinite(
    t: torch.Tensor, reference: torch.Tensor, invalid: torch.Tensor, name: str = ""
) -> str | None:
    """Where ``t`` first holds NaN or inf although the reference is finite, in words
    (``invalid``: where x's invalid rows are, to say which kind of row it is in)."""
    if tuple(t.shape) != tuple(reference.shape):
        return None
    bad = ~t.isfinite() & reference.isfinite()
    if not bad.any():
        return None
    index = [int(i) for i in bad.nonzero()[0]]
    row = ""
    if t.shape == invalid.shape:
        row = " (an invalid row)" if invalid[tuple(index)] else " (a valid row)"
    where = f"{name} at {index}" if name else f"at {index}"
    return f"{where}{row} {format_pair(t[tuple(index)], reference[tuple(index)], t.dtype)}"


SANITIZED_PADDING = make_clause(
    "sanitized_padding",
    "required",
    "NaN, ±inf and 1e30 in invalid rows of x change nothing, in every shape family (a 0-d"
    " valid, one row, every row invalid or valid, zero-size), on constant rows, exact zeros,"
    " C = 1 and a prime C, and in every grad mode",
    lambda seed: _poisoned_cases(seed, "sanitized_padding", grad=False),
    calls=_sanitized_padding_calls,
    judge=_sanitized_padding_judge,
)


# sanitized_gradients ------------------------------------------------------------------------------


def _sanitized_gradients_calls(cases: list[Case]) -> list[Call]:
    """Each poisoned case's backward, and the same with clean padding (to tell a NaN from the
    padding from one the function makes itself; not judged: the gradients clause judges
    clean padding). Zero-size cases have no gradient to judge (sanitized_padding calls them)."""
    return [
        call
        for i, case in enumerate(cases)
        if case.x.numel()
        for call in (
            Call(str(i), i, requires=GRAD_INPUTS, backward=True),
            Call(f"{i}.clean", i, clean=True, requires=GRAD_INPUTS, backward=True),
        )
    ]


def _sanitized_gradients_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    for call in one_call_each(cases, requires=GRAD_INPUTS, backward=True):
        case = cases[call.case]
        if not case.x.numel():
            continue
        problem = failure_detail(case, call, run)
        if problem is not None:
            return Verdict(False, problem)
        t = case.inputs()
        expected = reference_gradients(case)
        from_output = diagnose_call(case, call, run, cases)  # a wrong forward explains more
        for name, reference in expected.items():
            grad = run.tensor(call.key, name)
            nonfinite = _nonfinite(grad, reference, case.invalid(), name)
            if nonfinite is not None:
                clean = run.tensors.get(f"{call.key}.clean.{name}")
                diagnosis = _nan_diagnosis(name, grad, clean, reference, t)
                found = from_output or ([diagnosis] if diagnosis else [])
                if diagnosis is not None and diagnosis.mistake == NAN_WITHOUT_PADDING:
                    found = [*found, NAN_MADE_IN_PADDING]  # the probes tell which holds
                return Verdict(False, f"{case.label}: {nonfinite}", found)
        dx, expected_dx = run.tensor(call.key, "grad_x"), expected["grad_x"]
        if tuple(dx.shape) == tuple(case.x.shape):
            leaked = case.invalid() & (dx.double() != expected_dx)
            if leaked.any():
                index = tuple(int(i) for i in leaked.nonzero()[0])
                pair = format_pair(dx[index], expected_dx[index], dx.dtype)
                return Verdict(
                    False,
                    f"{case.label}: grad_x at {list(index)} (an invalid row) {pair}",
                    from_output or gradient_causes(case, call, run),
                )
        problem = judge_gradients(case, call, run)
        if problem is not None:
            return Verdict(False, problem, from_output or gradient_causes(case, call, run))
    return PASSED


SANITIZED_GRADIENTS = make_clause(
    "sanitized_gradients",
    "required",
    "with NaN, ±inf and 1e30 in invalid rows, in every shape family: dx is 0 there and every"
    " gradient is finite and right",
    lambda seed: _poisoned_cases(seed, "sanitized_gradients", grad=True),
    calls=_sanitized_gradients_calls,
    judge=_sanitized_gradients_judge,
)


# positive_zero ------------------------------------------------------------------------------------


def _positive_zero_cases(seed: int) -> list[Case]:
    g = draws.generator(seed, "positive_zero")
    cases = []
    shapes = [(families.RANDOM, dtype, 8) for dtype in (torch.float64, torch.float32)]
    shapes += [(families.ONE_CHANNEL, torch.float32, 1), (families.PRIME, torch.float64, 7)]
    for family, dtype, channels in shapes:
        # negative rows and negative bias: -0.0 if multiplied
        x = -draws.rows(g, (3, 6), channels).abs()
        negative = current().bias_words("bias negative", "x negative")
        label = f"{describe_inputs(x, dtype, 1e-5)}, {negative}"
        valid = draws.mask(g, (3, 6))
        params = draws.params(g, channels, negative_bias=True)
        cases.append(make_case(label, x, valid, params, 1e-5, dtype, family=family))
    return cases


def _positive_zero_verdict(case: Case, call: Call, run: ClauseRun) -> Verdict | None:
    out = run.tensor(call.key, "out")
    if tuple(out.shape) != tuple(case.x.shape):
        return Verdict(False, f"{case.label}: shape {list(out.shape)}")
    negative_zero = case.invalid() & (out == 0) & torch.signbit(out)
    if negative_zero.any():
        index = [int(i) for i in negative_zero.nonzero()[0]]
        detail = f"{case.label}: at {index} (an invalid row) gave -0.0, not +0.0"
        if not sign_of_multiplied_zeros(case, out):  # not where a multiplication puts them
            return Verdict(False, detail, [UNINITIALIZED])
        mistake = NEGATIVE_ZERO
        description = current().bias_words(mistake.description, NEGATIVE_ZERO_UNBIASED)
        diagnosis = Diagnosis(mistake.name, description, mistake.fix, 0.0)
        return Verdict(False, detail, [diagnosis])
    return None


POSITIVE_ZERO = make_clause(
    "positive_zero",
    "strict",
    "invalid outputs are +0.0, never -0.0",
    _positive_zero_cases,
    calls=one_call_each,
    judge=each_call_judge(_positive_zero_verdict),
)
