"""The clauses on accuracy: float32 rows far from zero (1e4 ± 0.1 and more offset ones) within a
factor of torch's own F.layer_norm's relative RMS error, which a one-pass variance is not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from maskln_cli.grading.clauses import draws
from maskln_cli.grading.clauses.calls import Call, ClauseRun, one_call_each
from maskln_cli.grading.clauses.cases import Case, describe_inputs, make_case
from maskln_cli.grading.clauses.clause import Judge, each_call_judge, make_clause
from maskln_cli.grading.clauses.families import OFFSET
from maskln_cli.grading.clauses.judging import (
    Verdict,
    diagnose_failures,
    format_pair,
    relative_rms_error,
    unravel,
)
from maskln_cli.op.mistakes import Diagnosis
from maskln_cli.op.reference import reference_masked_layer_norm

TWO_PASS_FACTOR = 4.0
OFFSET_FACTOR = 2.0
TWO_PASS_DATA = ((1e4, 0.1, 64),)
OFFSET_DATA = ((1e4, 0.1, 64), (1e3, 0.01, 64), (1e2, 1e-3, 64), (1e5, 1.0, 128))
OFFSET_ROWS = (32, 32)
"""About 920 valid rows per dataset: the RMS error of a correct kernel over that many rows
varies by a few percent from seed to seed (its worst element, by a factor of two)."""
ACCURACY_FLOOR = 1e-6
"""Relative RMS errors below this (float32 rounds to 6e-8) pass whatever F.layer_norm's is."""


def _offset_cases(seed: int, clause: str, data: Sequence[tuple[float, float, int]]) -> list[Case]:
    g = draws.generator(seed, clause)
    cases = []
    for offset, spread, channels in data:
        noise = torch.randn(*OFFSET_ROWS, channels, generator=g, dtype=torch.float64)
        x = offset + spread * noise
        valid = draws.mask(g, OFFSET_ROWS, fraction=0.9)
        label = describe_inputs(x, torch.float32, 1e-5, f"rows {offset:g} ± {spread:g}")
        cases.append(
            make_case(
                label, x, valid, draws.params(g, channels), 1e-5, torch.float32, family=OFFSET
            )
        )
    return cases


def layer_norm_error(case: Case) -> float:
    """The relative RMS error of torch's own F.layer_norm (padding zeroed) against the float64
    reference on this case: the yardstick of two_pass and offset_accuracy. An RMS over about a
    thousand rows, not the worst element: the worst element of two correct kernels differs by
    chance (which rows' means happen to round badly), by up to a factor of two."""
    t = case.inputs()
    keep = t["valid"][..., None]
    clean = torch.where(keep, t["x"], 0.0)
    ours = torch.nn.functional.layer_norm(clean, clean.shape[-1:], t["scale"], t["bias"], case.eps)
    # The specification's reference, whatever mistake is assumed (:mod:`.assumed`): the
    # yardstick is how far a correct kernel is from the truth.
    truth = reference_masked_layer_norm(t["x"], t["valid"], t["scale"], t["bias"], case.eps)
    return relative_rms_error(torch.where(keep, ours, 0.0), truth)


def _accuracy_judge(factor: float, diagnose: bool) -> Judge:
    def verdict(case: Case, call: Call, run: ClauseRun) -> Verdict | None:
        out = run.tensor(call.key, "out")
        reference = case.reference()
        if tuple(out.shape) != tuple(reference.shape):
            return Verdict(False, f"{case.label}: shape {list(out.shape)}")
        error = relative_rms_error(out, reference)
        yardstick = layer_norm_error(case)
        if not error <= max(factor * yardstick, ACCURACY_FLOOR):
            worst = (out.double() - reference).abs().nan_to_num(math.inf)
            index = unravel(int(worst.argmax()), worst.shape)
            pair = format_pair(out[tuple(index)], reference[tuple(index)], out.dtype)
            detail = (
                f"{case.label}: relative RMS error {error:.3g}; F.layer_norm's is"
                f" {yardstick:.3g}, the limit {factor:g}x that (the worst element, at"
                f" {index}, {pair})"
            )
            return Verdict(False, detail, _accuracy_diagnosis(case, out, diagnose))
        return None

    return each_call_judge(verdict)


def _accuracy_diagnosis(case: Case, out: torch.Tensor, every: bool) -> list[Diagnosis] | None:
    """The known mistakes a failing output matches (``every``: "none" too); else only those
    that match: a correct kernel less accurate than F.layer_norm (offset_accuracy) matches no
    mistake, and saying so would suggest one."""
    found = diagnose_failures([(case, out)])
    if every:
        return found
    return found or None


TWO_PASS = make_clause(
    "two_pass",
    "required",
    f"float32 rows 1e4 ± 0.1: RMS error within {TWO_PASS_FACTOR:g}x F.layer_norm's",
    lambda seed: _offset_cases(seed, "two_pass", TWO_PASS_DATA),
    calls=one_call_each,
    judge=_accuracy_judge(TWO_PASS_FACTOR, diagnose=True),
)


OFFSET_ACCURACY = make_clause(
    "offset_accuracy",
    "strict",
    f"offset float32 rows: RMS error within {OFFSET_FACTOR:g}x F.layer_norm's",
    lambda seed: _offset_cases(seed, "offset_accuracy", OFFSET_DATA),
    calls=one_call_each,
    judge=_accuracy_judge(OFFSET_FACTOR, diagnose=False),
)
