"""The clause on realistic sizes: rows as wide as a large model's (C up to 8,192, and odd widths
such as 4,095 and 1,000) and batches of several thousand rows, values and gradients. A kernel
that tiles its rows or its grid is wrong only past its tile (a warp of 32 channels, a block of
512, a grid of 1,024 rows): these cases are few but wide, so that a correct function still
grades in seconds.
"""

from __future__ import annotations

import torch

from maskln_cli.grading.clauses import draws, families
from maskln_cli.grading.clauses.calls import GRAD_INPUTS, Call, requiring_grad_words
from maskln_cli.grading.clauses.cases import Case, describe_inputs, make_case
from maskln_cli.grading.clauses.clause import make_clause, outputs_judge
from maskln_cli.grading.clauses.values import VALUE_SPREADS

LARGE_SHAPES = (
    ((4,), 8192, torch.float32, families.WIDE),
    ((6,), 4095, torch.float32, families.WIDE),
    ((5,), 1000, torch.float64, families.WIDE),
    ((2, 2100), 20, torch.float32, families.WIDE),
    ((4100,), 7, torch.float64, families.WIDE),
    ((3,), 2039, torch.float64, families.PRIME),
    ((2048,), 1, torch.float32, families.ONE_CHANNEL),
    ((8,), 1024, torch.float32, families.CONSTANT),
)
"""(leading shape, C, dtype, family) of each case: 8,192, 4,095 and 1,000 channels; 4,200 and
4,100 rows (past 1,024 and 4,096); a prime C of 2,039; 2,048 rows of one channel; wide
constant rows."""


def _large_cases(seed: int) -> list[Case]:
    g = draws.generator(seed, "large_shapes")
    cases = []
    for leading, channels, dtype, family in LARGE_SHAPES:
        if family == families.CONSTANT:
            x, eps, words = families.constant_rows(g, leading, channels), 0.1, "constant rows"
        else:
            x = draws.rows(g, leading, channels, spreads=VALUE_SPREADS, offset=2.0)
            eps, words = families.eps_for(family, dtype), "row variances 1e-8 to 4"
        label = describe_inputs(x, dtype, eps, words)
        valid = families.mask_for(family, x, g, leading)
        cases.append(
            make_case(
                label, x, valid, draws.params(g, channels), eps, dtype, g, grad=True, family=family
            )
        )
    return cases


def _large_calls(cases: list[Case]) -> list[Call]:
    """Each case without grad, and its backward with x, scale and bias requiring grad."""
    return [
        call
        for i in range(len(cases))
        for call in (Call(str(i), i), Call(f"{i}.grad", i, requires=GRAD_INPUTS, backward=True))
    ]


def _large_words(call: Call) -> str:
    return requiring_grad_words() if call.requires else ""


LARGE_SHAPES_CLAUSE = make_clause(
    "large_shapes",
    "required",
    "realistic sizes, values and gradients: C of 8,192, 4,095, 2,039 (prime) and 1,000; 4,200"
    " and 4,100 rows; 2,048 rows of C = 1; wide constant rows",
    _large_cases,
    calls=_large_calls,
    judge=outputs_judge(_large_calls, diagnose=True, what=_large_words),
)
