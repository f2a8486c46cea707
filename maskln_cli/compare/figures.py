"""The running figures of one tensor's comparison, and the outcome they make.

Both ways of comparing a chunk add to the same :class:`RunningFigures`: the fast path's blocks
(:mod:`maskln_cli.compare.blocks`), the general path's whole chunk
(:mod:`maskln_cli.compare.general`), and exact integers (:mod:`maskln_cli.compare.integers`).
What they add alike (failing rows, worst rows, invalid rows, row errors) is added here, once.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from maskln_cli.compare.data import (
    RECORDED_ROWS,
    WORST_ROWS,
    RowErrors,
    TensorComparison,
    WorstRow,
)

if TYPE_CHECKING:
    import torch


class RunningFigures:
    """What the chunks fed so far have shown, as running counts, maxima and sums (a
    :class:`~maskln_cli.compare.comparison.Comparison` adds how chunks are fed).

    Example:
        >>> figures = RunningFigures([2, 3], rank_by_ratio=False)
        >>> figures.row_length, figures.numel, figures.unravel(4)
        (3, 6, [1, 1])
    """

    def __init__(self, shape: Sequence[int], rank_by_ratio: bool) -> None:
        self.shape = list(shape)
        # Rows are the leading index; a tensor of rank 0 or 1 has one element per row.
        self.row_length = self.shape[-1] if len(self.shape) >= 2 else 1
        self.numel = math.prod(self.shape)
        # Worst rows by how far beyond their allowance (verify's budgets differ by element),
        # or by absolute difference (one tolerance for every element).
        self.rank_by_ratio = rank_by_ratio
        self.offset = 0
        """Elements compared so far: the flat index of the next chunk's first element."""
        self.mismatched = 0
        self.mismatched_rows = 0
        self.nan_mismatched = 0
        self.inf_mismatched = 0
        self.nan_where_finite = 0
        self.inf_where_finite = 0
        # value, flat index, actual, expected, allowed
        self.max_abs: tuple[float, int, float, float, float] = (
            -1.0,
            -1,
            math.nan,
            math.nan,
            math.nan,
        )
        self.max_rel: tuple[float, int] = (-1.0, -1)
        self.max_ratio = -1.0
        self.max_factor = 0.0
        """The greatest factor an element needed (see :meth:`factor_needed`)."""
        self.diff_squares = 0.0
        self.expected_squares = 0.0
        self.yardstick_max = -1.0
        self.yardstick_squares = 0.0
        self.invalid_rows_zero: bool | None = None
        self.mismatched_invalid_rows: int | None = None
        self.negative_zeros: int | None = None
        # Per valid row, the relative error: count, sum, sum of squares, min, max.
        self.row_errors = [0, 0.0, 0.0, math.inf, 0.0]
        self.yardstick_row_error_sum = 0.0
        self.failing_rows: list[int] = []
        """Indices of the first :data:`RECORDED_ROWS` failing rows (for a diagnosis)."""
        self.beyond = 0
        """Mismatched elements with finite values on both sides (beyond their allowance)."""
        self.beyond_in_invalid_rows = 0
        self.nonfinite_in_invalid_rows = 0
        """Mismatched elements in the rows marked invalid: finite, and NaN or inf."""
        # Heap of (score, -flat index, actual, expected, allowed): the worst rows so far.
        self.worst: list[tuple[float, int, float, float, float]] = []

    def factor_needed(self) -> float:
        """The smallest factor by which the budget units fed to :meth:`Comparison.update` would
        let every finite element pass (elements within what is always allowed count for
        nothing)."""
        return self.max_factor

    def count_failing_rows(self, rows_bad: torch.Tensor) -> None:
        """Count the rows of the chunk at :attr:`offset` with an element beyond (``rows_bad``,
        one flag per row), and remember the first of them."""
        self.mismatched_rows += int(rows_bad.sum())
        if len(self.failing_rows) < RECORDED_ROWS:
            more = rows_bad.nonzero().squeeze(1)[: RECORDED_ROWS - len(self.failing_rows)]
            self.failing_rows += (more + self.offset // self.row_length).tolist()

    def keep_worst(self, entry: tuple[float, int, float, float, float]) -> None:
        """Keep a mismatched row's worst element, ``(score, -flat index, actual, expected,
        allowed)``, if it is among the :data:`WORST_ROWS` worst so far."""
        if len(self.worst) < WORST_ROWS:
            heapq.heappush(self.worst, entry)
        else:
            heapq.heappushpop(self.worst, entry)

    def count_mismatched_invalid_rows(
        self, rows_bad: torch.Tensor | None, invalid: torch.Tensor
    ) -> None:
        """Count the rows marked ``invalid`` that have an element beyond (``rows_bad``: None
        when no row of the chunk has one)."""
        if rows_bad is not None:
            self.mismatched_invalid_rows = (self.mismatched_invalid_rows or 0) + int(
                (rows_bad & invalid).sum()
            )
        elif self.mismatched_invalid_rows is None:
            self.mismatched_invalid_rows = 0

    def add_padding(self, padding: tuple[bool, int] | None) -> None:
        """Add what :func:`padding_of` found in a chunk's invalid rows (None: it has none)."""
        if padding is not None:
            zero, negative = padding
            self.invalid_rows_zero = zero and self.invalid_rows_zero is not False
            self.negative_zeros = (self.negative_zeros or 0) + negative
        elif self.negative_zeros is None:
            self.negative_zeros = 0

    def add_row_errors(
        self,
        usable: torch.Tensor,
        row_squares: torch.Tensor,
        row_norms: torch.Tensor,
        yardstick_rows: torch.Tensor | None,
    ) -> None:
        """Each usable row's relative error (and the yardstick's), into the running sums."""
        if not bool(usable.any()):
            return
        norms = row_norms[usable]
        errors = (row_squares[usable] / norms).sqrt_()
        count, total, total_squares, low, high = self.row_errors
        self.row_errors = [
            count + errors.numel(), total + float(errors.sum()),
            total_squares + float(errors.square().sum()), min(low, float(errors.min())),
            max(high, float(errors.max())),
        ]  # fmt: skip
        if yardstick_rows is not None:
            self.yardstick_row_error_sum += float((yardstick_rows[usable] / norms).sqrt_().sum())

    def fill(self, outcome: TensorComparison) -> None:
        """Put the figures of every element compared into ``outcome``, and the problems they
        show into its problems."""
        rows = self.numel // self.row_length if self.row_length else 0
        outcome.numel = self.numel
        outcome.rows = rows
        outcome.mismatched = self.mismatched
        outcome.mismatched_fraction = float(self.mismatched / self.numel) if self.numel else 0.0
        outcome.mismatched_rows = self.mismatched_rows
        outcome.nan_mismatched = self.nan_mismatched
        outcome.inf_mismatched = self.inf_mismatched
        outcome.nan_where_finite = self.nan_where_finite
        outcome.inf_where_finite = self.inf_where_finite
        if self.max_abs[1] >= 0:
            outcome.max_abs_diff = self.max_abs[0]
            outcome.max_abs_index = self.unravel(self.max_abs[1])
            outcome.max_rel_diff = self.max_rel[0]
            outcome.max_rel_index = self.unravel(self.max_rel[1])
        outcome.budget_ratio = max(self.max_ratio, 0.0) if self.numel else None
        outcome.rel_l2 = self._relative(self.diff_squares)
        if self.yardstick_max >= 0:
            outcome.yardstick_max_abs_diff = self.yardstick_max
            outcome.yardstick_rel_l2 = self._relative(self.yardstick_squares)
        outcome.invalid_rows_zero = self.invalid_rows_zero
        outcome.mismatched_invalid_rows = self.mismatched_invalid_rows
        outcome.negative_zeros = self.negative_zeros
        count, total, total_squares, low, high = self.row_errors
        if count:
            mean = total / count
            spread = math.sqrt(max(total_squares / count - mean * mean, 0.0))
            outcome.row_rel_error = RowErrors(count, mean, spread, low, high)
        outcome.worst = self._worst_rows()
        if self.mismatched:
            outcome.problems.append(
                f"{self.mismatched:,} of {self.numel:,} elements differ beyond tolerance"
            )
        if self.invalid_rows_zero is False:
            outcome.problems.append("actual is not exactly 0 at every invalid position")

    def _relative(self, squares: float) -> float:
        if self.expected_squares > 0:
            return math.sqrt(squares / self.expected_squares)
        return 0.0 if squares == 0 else math.inf

    def _worst_rows(self) -> list[WorstRow]:
        """The worst rows, worst first, then the row of the greatest absolute difference when
        it is not among them (it may be within its allowance: the table then says so)."""
        worst = [
            self._worst_row(-negative_flat, actual, expected, allowed)
            for _, negative_flat, actual, expected, allowed in sorted(self.worst, reverse=True)
        ]
        value, flat, actual, expected, allowed = self.max_abs
        if worst and value > 0 and all(w.index != self.unravel(flat) for w in worst):
            worst.append(self._worst_row(flat, actual, expected, allowed))
        return worst

    def _worst_row(self, flat: int, actual: float, expected: float, allowed: float) -> WorstRow:
        index = self.unravel(flat)
        finite = math.isfinite(actual) and math.isfinite(expected)
        return WorstRow(
            row=index[:-1] if len(self.shape) >= 2 else index,
            index=index,
            actual=actual,
            expected=expected,
            abs_diff=abs(actual - expected) if finite else math.inf,
            allowed=allowed,
        )

    def unravel(self, flat: int) -> list[int]:
        """The index into the tensor of its element at ``flat``."""
        index = []
        for size in reversed(self.shape):
            flat, position = divmod(flat, size) if size else (flat, 0)
            index.append(position)
        return index[::-1]


def padding_of(padded: torch.Tensor) -> tuple[bool, int]:
    """Whether the actual values of the invalid rows (``padded``, in float64) are all exactly
    0, and how many of them are -0.0.

    In float64, exact for every dtype: float8 has no signbit, and e8m0 has no 0 (its byte 0 is
    2**-127), nor fnuz types a -0 (their 0x80 is NaN). float32, float16 and bfloat16 values
    may be given as they are: their zeros and signs are those of their float64 conversion.

    Those four dtypes are read first by their least and greatest value (one pass, NaN
    carried into both): both 0, every value is +0.0 or -0.0, and a -0.0 is one whose bits are
    not all 0 (its sign bit), counted in one more pass (at a sixth of the time of the
    comparisons below, which any other padding takes).
    """
    import torch

    bits = {
        torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
        torch.bfloat16: torch.int16,
    }.get(padded.dtype)  # fmt: skip
    if bits is not None and padded.numel():
        low, high = torch.aminmax(padded)
        if float(low) == 0 and float(high) == 0:
            return True, int(padded.view(bits).count_nonzero())
    zeros = padded == 0
    return bool(zeros.all()), int((zeros & padded.signbit()).sum())
