"""The opt-in clauses on half precision, beyond the specification (which names float32 and
float64): float16 and bfloat16 inputs, outputs and gradients in that dtype, within 4 units in the
last place (at 1) of the float64 reference. A kernel that accumulates in float32 errs by about
0.4 of them, torch's own half arithmetic by about 1.3 (values) and 2.7 at worst; one that keeps
its sums or its running statistics in half precision, or a formula wrong only for half inputs,
by far more.
"""

from __future__ import annotations

import itertools

import torch

from maskln_cli.grading.clauses import draws
from maskln_cli.grading.clauses.assumed import dtype_allowed
from maskln_cli.grading.clauses.calls import GRAD_INPUTS, Call, ClauseRun, one_call_each
from maskln_cli.grading.clauses.cases import Case, describe_inputs, dtype_name, make_case
from maskln_cli.grading.clauses.clause import Judge, make_clause
from maskln_cli.grading.clauses.judging import Verdict, diagnose_failures, judge_outputs

HALF_DTYPES = (torch.float16, torch.bfloat16)
HALF_SHAPES = (((2, 6), 8), ((1500,), 16), ((16,), 64), ((6,), 1000), ((3,), 4095))
"""(leading shape, C): narrow rows (a formula's mistake shows most), 1,500 rows (sums of
gradients over rows), and wide rows (sums over channels)."""
HALF_SPREADS = (1.0, 0.1, 2.0)
"""Row spreads: a variance well above eps, which half precision cannot resolve below ~1e-3."""


def _half_cases(seed: int, clause: str) -> list[Case]:
    g = draws.generator(seed, clause)
    cases = []
    for dtype, (leading, channels) in itertools.product(HALF_DTYPES, HALF_SHAPES):
        x = draws.rows(g, leading, channels, spreads=HALF_SPREADS, offset=2.0)
        label = describe_inputs(x, dtype, 1e-5)
        valid = draws.mask(g, leading)
        cases.append(
            make_case(label, x, valid, draws.params(g, channels), 1e-5, dtype, g, grad=True)
        )
    return cases


def _half_gradient_calls(cases: list[Case]) -> list[Call]:
    return one_call_each(cases, requires=GRAD_INPUTS, backward=True)


def _half_judge(calls_of, diagnose: bool) -> Judge:
    """The output's dtype first (a float32 output for float16 inputs is not a half-precision
    kernel, however accurate), then the values (and gradients) against the reference."""

    def judge(cases: list[Case], run: ClauseRun) -> Verdict:
        calls = calls_of(cases)
        for call in calls:
            case = cases[call.case]
            out = run.tensors.get(f"{call.key}.out")
            if out is not None and not dtype_allowed(out.dtype, case.x.dtype):
                detail = (
                    f"{case.label}: returned {dtype_name(out.dtype)}, not"
                    f" {dtype_name(case.x.dtype)}"
                )
                return Verdict(False, detail, diagnose_failures([(case, out)]))
        return judge_outputs(cases, run, calls, diagnose)

    return judge


HALF_VALUES = make_clause(
    "half_values",
    "optional",
    "float16 and bfloat16 inputs: the output in that dtype, within 4 ulps of the float64"
    " reference (float32 accumulation); C from 8 to 4,095, 1,500 rows",
    lambda seed: _half_cases(seed, "half_values"),
    calls=one_call_each,
    judge=_half_judge(one_call_each, diagnose=True),
)

HALF_GRADIENTS = make_clause(
    "half_gradients",
    "optional",
    "float16 and bfloat16 inputs: dx, dscale and dbias within 4 ulps (of the largest)",
    lambda seed: _half_cases(seed, "half_gradients"),
    calls=_half_gradient_calls,
    judge=_half_judge(_half_gradient_calls, diagnose=False),
)
