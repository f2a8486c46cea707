"""``assert_close`` and ``verify``: a kernel's tensors judged in memory as ``maskln verify``
judges them in files.

Both make a problem and a result of the tensors (:mod:`.inputs`) and hand them to
:func:`maskln_cli.verify.job.verify_problem`, the judgement ``maskln verify`` makes once its
files are open: the same error budget and yardstick, the same padding rule, the same
systematic-error test and diagnosis, the same figures. By default they judge as ``maskln verify
--strict``: the contract's invalid rows are exactly +0.0, so -0.0 there fails
(``strict=False``: as ``maskln verify`` without it, where -0.0 is reported and passes).
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from maskln_cli.compare.data import ComparisonReport
    from maskln_cli.files.problem import Problem
    from maskln_cli.testing.inputs import TensorResult

DEFAULT_FACTOR = 3.0
"""As ``maskln verify --factor`` (:data:`maskln_cli.verify.budget.DEFAULT_FACTOR`)."""


class VerifyFailed(AssertionError):
    """Raised by :func:`assert_close`: the message is the report in plain text, as
    ``maskln verify`` prints it (its verdict line first); ``report`` is the report as data."""

    def __init__(self, message: str, report: ComparisonReport) -> None:
        super().__init__(message)
        self.report = report


class NotCheckedWarning(UserWarning):
    """A passing :func:`assert_close` (or :func:`check_kernel`) could not check everything it
    judged: no row is valid, C = 1, valid rows of x holding NaN or inf, too few rows to tell a
    systematic error from rounding. Its message is what ``maskln verify``'s PASS line says
    after ``not checked:``."""


def verify(
    out: torch.Tensor | None,
    x: torch.Tensor,
    valid: torch.Tensor | None,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float | None = None,
    *,
    grad_out: torch.Tensor | None = None,
    grad_x: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None,
    grad_bias: torch.Tensor | None = None,
    factor: float = DEFAULT_FACTOR,
    strict: bool = True,
    norm: str = "layer",
    offset: float = 0.0,
) -> ComparisonReport:
    """Judge a kernel's ``out`` (and each gradient given) for these inputs, as ``maskln
    verify`` judges the same tensors saved in files, and return the report as data.

    Arguments are those of :func:`assert_close`. The report is what ``maskln verify --json``
    prints: ``report.passed``, and for each tensor judged (``report.tensors``, in the order
    out, grad_x, grad_scale, grad_bias) its figures: ``budget_ratio`` (the worst element's
    error over its budget: 1 or less passes), ``factor_needed`` (the ``factor`` that would
    let it pass), ``max_abs_diff``, ``rel_l2``, the yardstick's (PyTorch's) figures beside
    them, ``problems`` in words, and ``diagnosis``, the known mistakes it matches.
    ``report.to_dict()`` is plain JSON-ready data.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> x = torch.randn(4, 8)
        >>> valid = torch.tensor([True, True, True, False])
        >>> scale, bias = torch.ones(8), torch.zeros(8)
        >>> out = torch.where(valid[:, None], F.layer_norm(x, (8,), scale, bias, 1e-5), 0.0)
        >>> report = verify(out, x, valid, scale, bias, 1e-5)
        >>> report.passed, [t.name for t in report.tensors], report.tensors[0].budget_ratio < 1
        (True, ['out'], True)
    """
    from maskln_cli.testing.inputs import checked_names, problem_and_result

    gradients = {"grad_x": grad_x, "grad_scale": grad_scale, "grad_bias": grad_bias}
    check_judging(factor, strict)
    problem, result = problem_and_result(
        out, x, valid, scale, bias, eps, gradients, grad_out, norm, offset
    )
    return judge(problem, result, checked_names(out, gradients), factor, strict)


def judge(
    problem: Problem,
    result: TensorResult,
    names: tuple[str, ...],
    factor: float = DEFAULT_FACTOR,
    strict: bool = True,
) -> ComparisonReport:
    """verify's judgement of the tensors ``names`` of ``result`` for ``problem`` (made by
    :mod:`.inputs`), with ``factor`` and ``strict`` as :func:`assert_close` has them."""
    from maskln_cli.errors import MasklnError
    from maskln_cli.files.problem import NormalizeOptions
    from maskln_cli.verify.job import verify_problem
    from maskln_cli.verify.options import VerifyOptions

    options = VerifyOptions(check=names, factor=float(factor), strict=strict)
    try:
        return verify_problem(problem, result, NormalizeOptions(), options)
    except MasklnError as error:  # what verify refuses of files, here of arguments
        raise ValueError(str(error)) from None


def assert_close(
    out: torch.Tensor | None,
    x: torch.Tensor,
    valid: torch.Tensor | None,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float | None = None,
    *,
    grad_out: torch.Tensor | None = None,
    grad_x: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None,
    grad_bias: torch.Tensor | None = None,
    factor: float = DEFAULT_FACTOR,
    strict: bool = True,
    norm: str = "layer",
    offset: float = 0.0,
) -> None:
    """Assert that a kernel computed masked layer normalization right: each element of
    ``out`` (and of each gradient given) within its error budget of maskln's float64 result,
    and the invalid rows of ``out`` and ``grad_x`` exactly +0.0 (-0.0 fails), exactly as
    ``maskln verify --strict`` judges the same tensors in files.

    A fixed tolerance (``torch.testing.assert_close``'s) fails correct float16 kernels and
    rows with a large offset, and passes wrong kernels on easy rows; the budget is a few times
    what a correct kernel in the result's dtype errs on each row, checked against PyTorch's
    own ``F.layer_norm`` on the same data (the
    [error budget](../verify-budget.md) says how it is made).

    Args:
        out: the kernel's output, ``[..., C]`` like x (None: judge only the gradients).
        x: the input, ``[..., C]``, float32, float64, float16 or bfloat16, on any device
            and with any strides.
        valid: ``[...]``, x's leading shape: bool, or 0/1 numbers (1 = valid); None: every row.
        scale, bias: ``[C]`` floating tensors (None: ones, zeros; bias None for RMSNorm).
        eps: added to the variance inside the square root (RMSNorm: to ``mean(x**2)``);
            None: the norm's default, 1e-5 for LayerNorm, 1e-6 for RMSNorm.
        grad_out: the upstream gradient, x's shape; needed to judge any gradient.
        grad_x, grad_scale, grad_bias: the kernel's gradients of ``sum(out * grad_out)``
            (None: not judged).
        factor: how many times the modelled rounding an element may err (``maskln verify
            --factor``; at least 1).
        strict: -0.0 in the padding of ``out`` or ``grad_x`` fails (the contract: exactly
            +0.0, as ``maskln verify --strict``); False reports it and passes, as ``maskln
            verify`` does by default (for a kernel that masks by multiplying, when the sign of
            its zeros does not matter to you).
        norm: ``"layer"`` (LayerNorm), or ``"rms"``: RMSNorm, ``x / sqrt(mean(x**2) + eps) *
            (offset + scale)``, judged by RMSNorm's budget and ``F.rms_norm`` as
            ``maskln verify --norm rms`` judges it (no bias, no grad_bias; a failure names no
            cause, only where it differs).
        offset: RMSNorm's gain offset (Gemma's 1).

    Every tensor may be on any device (the reference is computed in float64 on the CPU) and in
    any floating dtype; each result is judged by its own dtype's budget, as verify judges
    the tensors of a file. Tensors are judged plain: a ``torch.Tensor`` or an
    ``nn.Parameter``; any other Tensor subclass decides what reading it returns (a wrong result
    could show the truth), so it is refused with a TypeError naming it, as is a nested tensor.

    Raises:
        AssertionError: a tensor fails (a :class:`VerifyFailed`): the message is the report
            as ``maskln verify`` prints it, its verdict line first: which tensor, how far
            beyond its budget, where, and the likely mistake with its fix.
        TypeError, ValueError: an argument is wrong; the message names it.

    Example:
        >>> import torch
        >>> from maskln_cli import masked_layer_normalization
        >>> x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)) + 1000
        >>> valid, scale, bias = torch.tensor([True, False, True]), torch.ones(16), torch.zeros(16)
        >>> out = masked_layer_normalization(x, valid, scale, bias, 1e-5)
        >>> assert_close(out, x, valid, scale, bias, 1e-5)  # passes: returns None
        >>> assert_close(out * 1.001, x, valid, scale, bias, 1e-5)
        Traceback (most recent call last):
        ...
        maskln_cli.testing.judging.VerifyFailed: FAIL: 1 of 1 tensors: out: all 2 valid rows ...
        ...
    """
    __tracebackhide__ = True  # pytest shows the test's line, not this function's
    report = verify(
        out, x, valid, scale, bias, eps, grad_out=grad_out, grad_x=grad_x,
        grad_scale=grad_scale, grad_bias=grad_bias, factor=factor, strict=strict, norm=norm,
        offset=offset,
    )  # fmt: skip
    if not report.passed:
        from maskln_cli.testing.text import failure_message

        raise VerifyFailed(failure_message(report), report)
    warn_not_checked(report, "assert_close")


def warn_not_checked(report: ComparisonReport, caller: str) -> None:
    """A passing report's ``not checked`` list as one :class:`NotCheckedWarning` pointing at
    the test's line: a None return must not hide that part of the judging saw nothing. Not
    inside a Hypothesis test: its strategies draw the edge cases (no valid row, C = 1, one
    row) on purpose, beside draws that check everything, so a warning per draw is noise."""
    missed = report.context.get("not_checked")
    if isinstance(missed, list) and missed and not _in_hypothesis_test():
        import warnings

        words = "; ".join(str(m) for m in missed)
        warnings.warn(f"{caller} passed; not checked: {words}", NotCheckedWarning, stacklevel=3)


def _in_hypothesis_test() -> bool:
    """Whether a Hypothesis test is running (never imports Hypothesis: a test using it has)."""
    import sys

    hypothesis = sys.modules.get("hypothesis")
    return hypothesis is not None and bool(hypothesis.currently_in_test_context())


def check_judging(factor: object, strict: object) -> None:
    """``factor`` and ``strict`` as the judging takes them (a TypeError or ValueError naming
    the one that is not)."""
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise TypeError(f"factor must be a number >= 1, got {type(factor).__name__}")
    if not (math.isfinite(float(factor)) and factor >= 1):
        raise ValueError(f"factor must be a finite number >= 1, got {factor!r}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, got {type(strict).__name__}")
