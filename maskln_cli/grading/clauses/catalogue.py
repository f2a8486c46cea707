"""The formulas of known mistakes the grader tries on a wrong output, by exercise: LayerNorm's
catalogue (:mod:`maskln_cli.op.mistakes`, with the grader's own formulas) or RMSNorm's
(:mod:`maskln_cli.op.rms_mistakes`), the very formulas verify matches with, so that verify and
grade name the same cause for the same kernel.

The cases keep LayerNorm's inputs (``x, valid, scale, bias, eps``) and an RMSNorm case holds a
bias its function is never given: RMSNorm's formulas here ignore it (the catalogue's are written
for a bias of zeros), as the exercise's reference does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from maskln_cli.grading.clauses.own_mistakes import GRADE_MISTAKES
from maskln_cli.grading.exercise import LAYER, RMS, current
from maskln_cli.op.mistake_records import Diagnosis, Formula, Mistake
from maskln_cli.op.mistakes import MISTAKES, MORE_MISTAKES, correct, diagnose_output
from maskln_cli.op.rms_mistakes import RMS_MISTAKES, rms_correct

__all__ = ["EVERY_FORMULA", "FORMULAS", "correct_formula", "diagnose_formulas", "formulas"]


def _without_bias(formula: Formula) -> Formula:
    """``formula`` given a bias of zeros whatever bias the case holds."""

    def unbiased(x: Any, valid: Any, scale: Any, bias: Any, eps: float) -> Any:
        return formula(x, valid, scale, torch.zeros_like(scale), eps)

    return unbiased


_CORRECT = {LAYER.name: correct, RMS.name: _without_bias(rms_correct)}

FORMULAS: dict[str, dict[str, Mistake]] = {
    LAYER.name: {**MISTAKES, **MORE_MISTAKES, **GRADE_MISTAKES},
    RMS.name: {
        name: replace(mistake, formula=_without_bias(mistake.formula))
        for name, mistake in RMS_MISTAKES.items()
    },
}
"""The formulas the grader tries, by exercise (RMSNorm's in the cases' convention)."""

EVERY_FORMULA = frozenset(name for found in FORMULAS.values() for name in found)
"""The name of every formula of every exercise (a probe confirms each the same way)."""


def formulas() -> dict[str, Mistake]:
    """The formulas of the exercise in force."""
    return FORMULAS[current().name]


def correct_formula() -> Formula:
    """The exercise's own formula in the catalogue's convention (its float64 reference)."""
    return _CORRECT[current().name]


def diagnose_formulas(
    out: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    dtype: torch.dtype,
    mistakes: dict[str, Mistake] | None = None,
) -> list[Diagnosis]:
    """The formulas of ``mistakes`` (default: the exercise's) that ``out`` matches, by the
    catalogue's rule (:func:`maskln_cli.op.mistakes.diagnose_output`) against the exercise's
    own truth: RMSNorm's with no bias."""
    exercise = current()
    if exercise.name == RMS.name:
        bias = torch.zeros_like(scale)
    mistakes = formulas() if mistakes is None else mistakes
    return diagnose_output(out, x, valid, scale, bias, eps, dtype,
                           mistakes=mistakes, norm=exercise.name)  # fmt: skip
