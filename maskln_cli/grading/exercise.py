"""The exercise a grade judges, as a table: masked LayerNorm (the specification's) or masked
RMSNorm (issue 39), one parameter of the whole grader rather than a copy of it.

Every part reads the exercise in force (:func:`current`, set with :func:`exercising`): how the
function is called (:meth:`Exercise.arguments`), which inputs take gradients, the float64
reference the clauses judge against, the default eps the signature must declare, and which
clauses do not apply. The cases keep LayerNorm's inputs (``x, valid, scale, bias, eps``); an
exercise without a bias is simply never given one, and its reference ignores it. The grader's
child process grades under the exercise its parent names (:mod:`.sandbox`).

The RMSNorm exercise is LLaMA's: ``masked_rms_normalization(x, valid, scale, eps=1e-6)``, valid
rows ``x / sqrt(mean(x**2) + eps) * scale`` over the last axis, invalid rows exactly +0.0. No
``offset`` (Gemma's ``1 + scale``): the gain is ``scale``; a submission may declare an offset
keyword of its own, which the grader leaves at its default.

This module imports no torch (the command line checks ``--op`` before anything slow loads).

Example:
    >>> with exercising("rms"):
    ...     current().function_name, current().arguments("x", "valid", "scale", "bias", "eps")
    ('masked_rms_normalization', ('x', 'valid', 'scale', 'eps'))
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from maskln_cli.errors import MasklnError

__all__ = ["EXERCISES", "LAYER", "RMS", "Exercise", "check_op", "current", "exercising"]


@dataclass(frozen=True)
class Exercise:
    """One exercise: the op ``name`` (``--op``), how reports ``title`` it, the graded
    function's default name, its ``inputs`` in order (eps last), its default eps, the clauses
    that do not apply to it, with why (``not_run``), and the kinds of cause a probe may
    confirm for it (:data:`maskln_cli.grading.confirm.KINDS`; None: every kind). RMSNorm's
    causes are those the clauses observe (an input mutated, NaN from the padding, a ready-made
    norm recorded running), exceptions raised again, and the formulas of its own catalogue
    (:mod:`maskln_cli.op.rms_mistakes`, as verify names them) confirmed by the formula probe;
    LayerNorm's precisions, data families and gradient patterns are not RMSNorm's, and a
    cause is named only when confirmed."""

    name: str
    title: str
    function_name: str
    inputs: tuple[str, ...]
    default_eps: float
    not_run: dict[str, str] = field(default_factory=dict)
    confirms: tuple[str, ...] | None = None

    @property
    def patterns(self) -> bool:
        """Whether LayerNorm's diagnoses beyond the formula catalogue apply: precisions, data
        families, zero-variance rows, gradient patterns and second-order formulas (else only
        the catalogue's formulas and the causes :attr:`confirms` kinds of probe can confirm)."""
        return self.confirms is None

    @property
    def grad_inputs(self) -> tuple[str, ...]:
        """The inputs a gradient is taken with respect to."""
        return tuple(name for name in ("x", "scale", "bias") if name in self.inputs)

    @property
    def signature(self) -> str:
        """``(x, valid, scale, eps=1e-06)``, in words."""
        return f"({', '.join(self.inputs[:-1])}, eps={self.default_eps!r})"

    def bias_words(self, words: str, otherwise: str = "") -> str:
        """``words`` when the exercise has a bias, else ``otherwise``: labels and messages
        speak of a bias only where there is one.

        Example:
            >>> RMS.bias_words("scale and bias", "scale"), LAYER.bias_words(", bias nonzero")
            ('scale', ', bias nonzero')
        """
        return words if "bias" in self.inputs else otherwise

    def arguments(self, *names: str) -> tuple[str, ...]:
        """``names`` that this exercise's function takes, in order."""
        return tuple(name for name in names if name in self.inputs)

    def reference(self, x: Any, valid: Any, scale: Any, bias: Any, eps: float) -> Any:
        """The float64 reference in the cases' convention (a bias it has not is ignored)."""
        from maskln_cli.op import reference

        if self.name == RMS.name:
            return reference.reference_masked_rms_norm(x, valid, scale, eps)
        return reference.reference_masked_layer_norm(x, valid, scale, bias, eps)

    def outer(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        """``inner`` (the cases' convention, ``(x, valid, scale, bias, eps)``) as this
        exercise's function is called: RMSNorm's without a bias."""
        if "bias" in self.inputs:
            return inner

        def called(x: Any, valid: Any, scale: Any, eps: float = self.default_eps) -> Any:
            return inner(x, valid, scale, None, eps)

        return called


LAYER = Exercise(
    "layer",
    "LayerNorm",
    "masked_layer_normalization",
    ("x", "valid", "scale", "bias", "eps"),
    1e-5,
)
RMS = Exercise(
    "rms",
    "RMSNorm",
    "masked_rms_normalization",
    ("x", "valid", "scale", "eps"),
    1e-6,
    not_run={
        "two_pass": "it probes the mean's subtraction (a one-pass variance), which RMSNorm has not",
        "offset_accuracy": "it compares with F.layer_norm's error on rows far from zero, where"
        " only a centered norm cancels",
    },
    confirms=("observed", "rerun", "formula"),
)
EXERCISES = {exercise.name: exercise for exercise in (LAYER, RMS)}
"""Every exercise, by ``--op`` name."""

_CURRENT: contextvars.ContextVar[Exercise] = contextvars.ContextVar("exercise", default=LAYER)


def current() -> Exercise:
    """The exercise in force (LayerNorm unless :func:`exercising` says otherwise)."""
    return _CURRENT.get()


def check_op(name: str, option: str = "--op") -> Exercise:
    """The exercise named ``name``; a usage error naming ``option`` otherwise.

    Example:
        >>> check_op("rms").title
        'RMSNorm'
    """
    found = EXERCISES.get(name) if isinstance(name, str) else None
    if found is None:
        raise MasklnError(
            f"{option}: no exercise {name!r}; the exercises are {', '.join(EXERCISES)}"[:300]
        )
    return found


@contextlib.contextmanager
def exercising(name: str) -> Iterator[Exercise]:
    """Grade the exercise ``name`` inside the block."""
    token = _CURRENT.set(check_op(name))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def grade_in_this_process(name: str) -> None:
    """Grade the exercise ``name`` from now on in this process (the grader's child, which
    grades one function of one exercise)."""
    _CURRENT.set(check_op(name))


def not_run(names: Sequence[str], name: str, option: str = "--only") -> None:
    """A usage error when clauses ``names`` are asked for but do not apply to exercise
    ``name``."""
    exercise = check_op(name)
    for clause in names:
        if clause in exercise.not_run:
            raise MasklnError(
                f"{option}: {clause} is not run for {exercise.title}: {exercise.not_run[clause]}"
            )
