"""What the clauses judge against: the specification, or, to see whether a known mistake explains
a clause's failure, that mistake (:class:`Assumption`, set with :func:`assuming`).

A clause judged under an assumption compares what the function gave with the mistake's formula
instead of the op (:func:`reference_formula`), and allows the assumed precision: its tolerances
(:func:`tolerance_dtype`) and its dtype (:func:`dtype_allowed`). A clause that passes so fails
only through that mistake: one mistake, fixed once, fixes it too.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from maskln_cli.grading.exercise import current
from maskln_cli.op.reference import reference_masked_layer_norm

Formula = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Assumption:
    """A known mistake, as the clauses judge it: its formula (float64, as
    :data:`maskln_cli.op.mistakes.MISTAKES` holds them), and/or the lower precision it computes
    or returns in."""

    formula: Formula | None = None
    precision: torch.dtype | None = None


_ASSUMED: contextvars.ContextVar[Assumption | None] = contextvars.ContextVar(
    "assumed", default=None
)

_PRECISION_ORDER = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@contextlib.contextmanager
def assuming(assumption: Assumption) -> Iterator[None]:
    """Judge as if ``assumption`` were the contract, inside the block."""
    token = _ASSUMED.set(assumption)
    try:
        yield
    finally:
        _ASSUMED.reset(token)


def reference_formula() -> Formula:
    """The op (float64, :func:`reference_masked_layer_norm`; the exercise's own reference when
    another is graded, :mod:`maskln_cli.grading.exercise`), or the assumed mistake's formula,
    in the cases' convention ``(x, valid, scale, bias, eps)``.

    Example:
        >>> reference_formula() is reference_masked_layer_norm
        True
    """
    assumption = _ASSUMED.get()
    if assumption is None or assumption.formula is None:
        exercise = current()
        return reference_masked_layer_norm if exercise.name == "layer" else exercise.reference
    formula = assumption.formula

    def mistaken(x, valid, scale, bias, eps=1e-5):
        return formula(x.double(), valid, scale.double(), bias.double(), eps)

    return mistaken


def tolerance_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype whose tolerances apply to results of a ``dtype`` case: its own, or the assumed
    lower precision.

    Example:
        >>> with assuming(Assumption(precision=torch.float32)):
        ...     tolerance_dtype(torch.float64)
        torch.float32
    """
    assumption = _ASSUMED.get()
    if assumption is None or assumption.precision is None:
        return dtype
    lower = assumption.precision
    if dtype in _PRECISION_ORDER and lower in _PRECISION_ORDER:
        return max(dtype, lower, key=_PRECISION_ORDER.index)
    return dtype


def dtype_allowed(returned: torch.dtype, expected: torch.dtype) -> bool:
    """Whether an output of dtype ``returned`` is accepted for inputs of dtype ``expected``:
    the same, or the assumed precision."""
    assumption = _ASSUMED.get()
    return returned == expected or (assumption is not None and returned == assumption.precision)


def assumed() -> Assumption | None:
    """The assumption in force (None: the specification)."""
    return _ASSUMED.get()
