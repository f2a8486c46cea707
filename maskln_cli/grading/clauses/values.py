"""The clauses on values: the signature (eps's default, positional and keyword calls), the
specification's worked example, and random cases against the float64 reference.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools

import torch

from maskln_cli.grading.clauses import draws, families
from maskln_cli.grading.clauses.assumed import assumed, dtype_allowed
from maskln_cli.grading.clauses.calls import (
    GRAD_INPUTS,
    MODE_WORDS,
    Call,
    ClauseRun,
    Fn,
    requiring_grad_words,
    run_calls,
)
from maskln_cli.grading.clauses.cases import (
    Case,
    describe_inputs,
    dtype_name,
    labelled,
    make_case,
)
from maskln_cli.grading.clauses.clause import make_clause, outputs_judge
from maskln_cli.grading.clauses.judging import (
    EXACT,
    PASSED,
    Verdict,
    diagnose_failures,
    failure_detail,
    first_mismatch,
    judge_outputs,
    value_mismatch,
)
from maskln_cli.grading.exercise import current
from maskln_cli.op.mistakes import Diagnosis

# signature ----------------------------------------------------------------------------------------


def style_words(style: str) -> str:
    """How a call of a ``style`` is made, with the exercise's arguments.

    Example:
        >>> style_words("keyword_default")
        'called f(x=x, valid=valid, scale=scale, bias=bias) without eps'
    """
    names = current().arguments("x", "valid", "scale", "bias")
    keyword = style.startswith("keyword")
    given = [f"{name}={name}" if keyword else name for name in names]
    if style.endswith("_default"):
        return f"called f({', '.join(given)}) without eps"
    return f"called f({', '.join([*given, 'eps=eps' if keyword else 'eps'])})"


def _signature_cases(seed: int) -> list[Case]:
    g = draws.generator(seed, "signature")
    # Rows of variance near 1e-5: eps 1e-5, 1e-6 or 1e-12 give clearly different outputs.
    x = draws.rows(g, (2, 6), 16, spreads=(3e-3, 5e-3))
    valid = draws.mask(g, (2, 6))
    params = draws.params(g, 16)
    given = make_case(describe_inputs(x, torch.float64, 0.1), x, valid, params, 0.1, torch.float64)
    eps = current().default_eps  # the default the exercise declares
    default = make_case(describe_inputs(x, torch.float64, eps), x, valid, params, eps,
                        torch.float64)  # fmt: skip
    cases = [given, default]
    for family, channels in ((families.ONE_CHANNEL, 1), (families.PRIME, 7)):
        x = draws.rows(g, (2, 6), channels, spreads=(3e-3, 5e-3))
        label = describe_inputs(x, torch.float64, eps)
        params = draws.params(g, channels)
        cases.append(
            make_case(label, x, draws.mask(g, (2, 6)), params, eps, torch.float64, family=family)
        )
    return cases


def _signature_calls(cases: list[Case]) -> list[Call]:
    """eps given (case 0) and left out (case 1, and the C = 1 and prime C cases), each called
    positionally and by keyword."""
    calls = [
        Call("positional", 0, style="positional"),
        Call("keyword", 0, style="keyword"),
        Call("positional_default", 1, style="positional_default"),
        Call("keyword_default", 1, style="keyword_default"),
    ]
    for i in range(2, len(cases)):
        calls += [
            Call(f"{i}.positional_default", i, style="positional_default"),
            Call(f"{i}.keyword", i, style="keyword"),
        ]
    return calls


def _signature_run(fn: Fn, cases: list[Case], device: str) -> ClauseRun:
    run = run_calls(fn, cases, _signature_calls(cases), device)
    with contextlib.suppress(Exception):  # a builtin or C function may have no signature
        parameter = inspect.signature(fn).parameters.get("eps")
        if parameter is not None and parameter.default is not inspect.Parameter.empty:
            run.meta["declared"] = {"eps": repr(parameter.default)}
    return run


def _signature_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    verdict = judge_outputs(
        cases,
        run,
        _signature_calls(cases),
        diagnose=True,
        what=lambda call: f", {style_words(call.style)}",
    )
    declared = run.meta.get("declared", {}).get("eps")
    default = current().default_eps
    if not verdict.passed and isinstance(declared, str) and declared != repr(default):
        verdict.detail = f"{verdict.detail} (the signature declares eps={declared[:40]})"
        if not verdict.diagnosis and "without eps" in (verdict.detail or ""):
            verdict.diagnosis = [
                Diagnosis(
                    "eps_default",
                    f"eps defaults to {declared[:40]}, not {default!r} (another library's"
                    " default?): calls that leave eps out get another result",
                    f"declare eps: float = {default!r}",
                    0.0,
                )
            ]
    return verdict


SIGNATURE = make_clause(
    "signature",
    "required",
    "callable as (x, valid, scale, bias, eps=1e-05) (RMSNorm: (x, valid, scale, eps=1e-06)),"
    " positionally and by keyword",
    _signature_cases,
    run=_signature_run,
    judge=_signature_judge,
)


# worked_example -----------------------------------------------------------------------------------

WORKED_EXPECTED = [[[-0.5, 0.5], [0.0, 0.0]]]
RMS_WORKED_EXPECTED = [[[1.5, -1.0], [0.0, 0.0]]]
"""RMSNorm's worked example (the op's own docstring's, without the offset): the row [3, 4]
has mean square 12.5; with eps 3.5 its rms is 4, so it gives [0.75, 1] * [2, -1]. Exact
binary fractions, as LayerNorm's are."""


def _worked_cases(seed: int) -> list[Case]:
    rms = current().name == "rms"
    x = torch.tensor([[[3.0, 4.0] if rms else [1.0, 3.0], [99.0, -99.0]]], dtype=torch.float64)
    valid = torch.tensor([[True, False]], dtype=torch.bool)
    scale = torch.tensor([2.0, -1.0], dtype=torch.float64)
    bias = torch.tensor([0.5, 1.0], dtype=torch.float64)
    eps = 3.5 if rms else 3.0
    label = labelled(families.WORKED, f"x [1, 2, 2] float64, eps {eps:g}, every argument named")
    return [Case(label, x, valid, scale, bias, eps, family=families.WORKED)]


# As the specification writes it: x, scale and bias require grad; every argument is named.
_WORKED_CALL = Call("0", 0, style="keyword", requires=GRAD_INPUTS)


def _worked_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    case = cases[0]
    problem = failure_detail(case, _WORKED_CALL, run)
    if problem is not None:
        return Verdict(False, problem)
    out = run.tensor("0", "out")
    if not dtype_allowed(out.dtype, torch.float64):
        detail = f"{case.label}: returned {dtype_name(out.dtype)}, not float64"
        return Verdict(False, detail, diagnose_failures([(case, out)]))
    if assumed() is None:
        numbers = RMS_WORKED_EXPECTED if current().name == "rms" else WORKED_EXPECTED
        expected = torch.tensor(numbers, dtype=torch.float64)
        mismatch = first_mismatch(out, expected, 0.0, EXACT)
    else:  # judged against an assumed mistake: its formula, at its precision
        mismatch = value_mismatch(out, case.reference(), torch.float64)
    if mismatch is None:
        return PASSED
    return Verdict(False, f"{case.label}: {mismatch}", diagnose_failures([(case, out)]))


WORKED_EXAMPLE = make_clause(
    "worked_example",
    "required",
    "the specification's worked example, exactly (float64)",
    _worked_cases,
    calls=lambda cases: [_WORKED_CALL],
    judge=_worked_judge,
)


# values -------------------------------------------------------------------------------------------

VALUE_CHANNELS = (1, 2, 3, 16, 64)
EPSILONS = (1e-5, 0.1, 3.0)
# Row spreads from 1e-4 (variance 1e-8: eps dominates) to 2: where eps is added matters.
VALUE_SPREADS = (1.0, 1e-4, 2.0, 1e-3, 0.3, 3e-3, 1e-2, 1.5, 3e-4, 0.05)
TAIL_CHANNELS = (9, 12, 17, 31, 33, 100, 129, 257)
"""Channel counts past a vector width that are not multiples of 8 or 16: a kernel that loses
its remainder loop (the last C % 8 channels) is wrong on these only."""
MANY_ROWS = ((3, 331), 20)
"""993 rows (not a multiple of any block of rows) of 20 channels."""


def _values_cases(seed: int) -> list[Case]:
    g = draws.generator(seed, "values")
    cases = []
    for dtype, channels, eps in itertools.product(
        (torch.float64, torch.float32), VALUE_CHANNELS, EPSILONS
    ):
        x = draws.rows(g, (2, 5), channels, spreads=VALUE_SPREADS, offset=2.0)
        label = describe_inputs(x, dtype, eps, "row variances 1e-8 to 4")
        cases.append(
            make_case(label, x, draws.mask(g, (2, 5)), draws.params(g, channels), eps, dtype)
        )
    for dtype, channels in itertools.product((torch.float64, torch.float32), TAIL_CHANNELS):
        x = draws.rows(g, (3, 3), channels, spreads=VALUE_SPREADS, offset=2.0)
        label = describe_inputs(x, dtype, 1e-5, "row variances 1e-8 to 4")
        cases.append(
            make_case(label, x, draws.mask(g, (3, 3)), draws.params(g, channels), 1e-5, dtype)
        )
    leading, channels = MANY_ROWS
    for dtype in (torch.float64, torch.float32):
        x = draws.rows(g, leading, channels, spreads=VALUE_SPREADS, offset=2.0)
        label = describe_inputs(x, dtype, 1e-5, "row variances 1e-8 to 4")
        cases.append(
            make_case(label, x, draws.mask(g, leading), draws.params(g, channels), 1e-5, dtype)
        )
    cases += families.family_cases(g)
    if current().name == "rms":  # its own families, drawn after the shared ones
        cases += families.rms_cases(g)
    for dtype, eps in itertools.product((torch.float64, torch.float32), families.EPS_RANGE):
        x = families.eps_rows(g, (2, 6), 16, eps)
        label = describe_inputs(x, dtype, eps, "row variances 0.01, 1 and 100 times eps")
        cases.append(
            make_case(
                label,
                x,
                draws.mask(g, (2, 6)),
                draws.params(g, 16),
                eps,
                dtype,
                family=families.EPS,
            )
        )
    return cases


def _values_calls(cases: list[Case]) -> list[Call]:
    """Each case without grad, with x, scale and bias requiring grad (a training path must
    give the same values), and with them requiring grad under torch.no_grad() and under
    torch.inference_mode() (so must an inference path)."""
    return [
        call
        for i in range(len(cases))
        for call in (
            Call(str(i), i),
            Call(f"{i}.grad", i, requires=GRAD_INPUTS),
            Call(f"{i}.no_grad", i, requires=GRAD_INPUTS, mode="no_grad"),
            Call(f"{i}.inference", i, requires=GRAD_INPUTS, mode="inference"),
        )
    ]


def _grad_words(call: Call) -> str:
    if call.mode != "grad":
        return f", {MODE_WORDS[call.mode]}"
    return requiring_grad_words() if call.requires else ""


VALUES = make_clause(
    "values",
    "required",
    "random cases against the float64 reference: float32 and float64, C from 1 to 257"
    " (9, 17, 33, ...: not multiples of 8), 993 rows, rows of small variance; constant rows,"
    " exact zeros, C = 1, a prime C, eps from 1e-12 to 10; with and without grad, under"
    " torch.no_grad() and torch.inference_mode()",
    _values_cases,
    calls=_values_calls,
    judge=outputs_judge(_values_calls, diagnose=True, what=_grad_words),
)
