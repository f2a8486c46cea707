"""Comparing integers and bool exactly, in their own values: float64 cannot tell ``2**53 + 1``
from ``2**53``.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING

from maskln_cli.compare.comparison import Comparison
from maskln_cli.compare.data import INTEGRAL_DTYPES, WORST_ROWS
from maskln_cli.files.tensorfile import dtype_name

if TYPE_CHECKING:
    import torch


def is_integral(dtype: torch.dtype | None) -> bool:
    """Whether ``dtype`` holds integers (bool included): compared exactly, not as float64.

    Example:
        >>> import torch
        >>> is_integral(torch.uint64), is_integral(torch.bool), is_integral(torch.float16)
        (True, True, False)
    """
    return dtype is not None and dtype_name(dtype) in INTEGRAL_DTYPES


LOW_BITS = 2**32 - 1


class ExactIntegers:
    """Integers of any dtype (bool, int8 to int64, uint8 to uint64) as exact pairs of int64
    tensors, ``value = high * 2**32 + low`` with ``0 <= low < 2**32``.

    torch has no integer wider than 64 bits, and barely computes with uint64; as pairs, sums,
    differences and their magnitudes (up to 2**65) stay exact, and comparisons are
    lexicographic. uint64 values of 2**63 and up are read from their bits.

    Example:
        >>> import torch
        >>> a = ExactIntegers.of(torch.tensor([2**62, -5]))
        >>> b = ExactIntegers.of(torch.tensor([-(2**62), 3]))
        >>> d = a.minus(b).magnitude()
        >>> d.value(0) == 2**63, d.value(1)
        (True, 8)
    """

    __slots__ = ("high", "low")

    def __init__(self, high: torch.Tensor, low: torch.Tensor) -> None:
        self.high = high
        self.low = low

    @classmethod
    def of(cls, values: torch.Tensor) -> ExactIntegers:
        import torch

        if values.dtype == torch.uint64:
            bits = values.view(torch.int64)  # the same bits; >> is arithmetic, hence the mask
            return cls((bits >> 32) & LOW_BITS, bits & LOW_BITS)
        bits = values.long()
        return cls(bits >> 32, bits & LOW_BITS)

    def minus(self, other: ExactIntegers) -> ExactIntegers:
        """``self - other``, exactly (a borrow from the low halves is carried)."""
        low = self.low - other.low  # in (-2**32, 2**32)
        high = self.high - other.high + (low >> 32)  # >> 32 is -1 for a negative low, else 0
        return ExactIntegers(high, low & LOW_BITS)

    def magnitude(self) -> ExactIntegers:
        """``|self|``, exactly."""
        import torch

        negative = self.high < 0
        borrow = negative & (self.low != 0)
        high = torch.where(negative, -self.high - borrow.long(), self.high)
        low = torch.where(borrow, (1 << 32) - self.low, self.low)
        return ExactIntegers(high, low)

    def nonzero_mask(self) -> torch.Tensor:
        """Where the value is not 0."""
        return (self.high != 0) | (self.low != 0)

    def greater_than(self, bound: int) -> torch.Tensor:
        """Where the value exceeds the integer ``bound``, exactly."""
        high, low = bound >> 32, bound & LOW_BITS
        return (self.high > high) | ((self.high == high) & (self.low > low))

    def as_float64(self) -> torch.Tensor:
        """The values rounded to float64 (rounded once: ``high * 2**32`` is exact)."""
        return self.high.double().mul_(2.0**32).add_(self.low)

    def value(self, index: int) -> int:
        return int(self.high[index]) * 2**32 + int(self.low[index])

    def masked(self, keep: torch.Tensor | None) -> ExactIntegers:
        """Every value set to 0 where ``keep`` (bool, same shape) is False."""
        if keep is None:
            return self
        return ExactIntegers(self.high * keep, self.low * keep)

    def rows(self, length: int) -> ExactIntegers:
        return ExactIntegers(self.high.view(-1, length), self.low.view(-1, length))

    def argmax(self) -> tuple[int, int]:
        """The greatest value and its first index (the values are 1-d and not all masked out,
        see :meth:`row_max`)."""
        import torch

        high = self.high.max()
        low, index = torch.where(self.high == high, self.low, -1).max(dim=0)
        return int(high) * 2**32 + int(low), int(index)

    def row_max(self) -> tuple[ExactIntegers, torch.Tensor]:
        """Each row's greatest value (of a 2-d pair) and its first column."""
        import torch

        high = self.high.max(dim=1).values
        low, column = torch.where(self.high == high[:, None], self.low, -1).max(dim=1)
        return ExactIntegers(high, low), column

    def descending(self, candidates: torch.Tensor) -> torch.Tensor:
        """``candidates`` (1-d indices) ordered by value, greatest first; equal values keep
        their order (two stable sorts: by the low halves, then by the high ones)."""
        order = self.low[candidates].sort(descending=True, stable=True).indices
        candidates = candidates[order]
        order = self.high[candidates].sort(descending=True, stable=True).indices
        return candidates[order]


def _exact_ratio(numerator: int, denominator: int) -> float:
    """``numerator / denominator`` rounded once; inf over 0 (0 for 0 / 0)."""
    if denominator == 0:
        return math.inf if numerator else 0.0
    return float(Fraction(numerator, denominator))


class IntegerComparison(Comparison):
    """:class:`Comparison` of integer or bool tensors, exactly, in their own values.

    ``|actual - expected|`` is exact (as :class:`ExactIntegers`), and so is the verdict: with the
    default tolerance (0 and 0) the values must be equal; ``atol`` and ``rtol`` allow
    ``|a - e| <= atol + rtol * |e|``, decided exactly (by rational arithmetic where float64 is
    too close to call). ``max_abs_diff`` and the worst rows' values are exact Python ints;
    ``max_rel_diff``, ``rel_l2`` and ``budget_ratio`` are ratios, rounded once to float64.
    There are no allowances, yardsticks or invalid rows (``verify`` judges floating results).

    Example:
        >>> import torch
        >>> comparison = IntegerComparison("t", [2], "int64", [2], "int64")
        >>> comparison.update(torch.tensor([2**62, 7]), torch.tensor([2**62 + 1, 7]))
        >>> result = comparison.result()
        >>> result.passed, result.max_abs_diff, result.worst[0].actual == 2**62
        (False, 1, True)
    """

    def update(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        invalid_rows: torch.Tensor | None = None,
        allowance: torch.Tensor | None = None,
        yardstick: torch.Tensor | None = None,
        budget_unit: torch.Tensor | None = None,
        always: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> None:
        """Compare the next chunk of rows; ``keep`` (bool, one per element) leaves the other
        elements out (they compare equal)."""
        import torch

        if any(v is not None for v in (invalid_rows, allowance, yardstick, budget_unit, always)):
            raise ValueError("integer comparisons take no allowance, yardstick or invalid rows")
        actual, expected = actual.detach().reshape(-1), expected.detach().reshape(-1)
        count = actual.numel()
        if count != expected.numel() or count % self.row_length:
            raise ValueError("chunks must hold the same whole rows of both tensors")
        if count == 0:
            return
        if keep is None and actual.dtype == expected.dtype and torch.equal(actual, expected):
            self._update_equal(ExactIntegers.of(expected))  # the usual case, at once
            return
        a = ExactIntegers.of(actual).masked(keep)
        e = ExactIntegers.of(expected).masked(keep)
        difference = a.minus(e).magnitude()
        scale = e.magnitude()
        diff, magnitude = difference.as_float64(), scale.as_float64()
        bad, bound = self._beyond(difference, scale, diff, magnitude)
        chunk_bad = int(bad.sum())
        self.mismatched += chunk_bad
        self.beyond += chunk_bad

        value, index = difference.argmax()
        if value > self.max_abs[0]:
            expected_value = e.value(index)
            self.max_abs = (
                value, self.offset + index, a.value(index), expected_value,
                self._allowed(expected_value),
            )  # fmt: skip
        relative = (diff / magnitude).nan_to_num_(nan=0.0, posinf=math.inf)
        index = int(relative.argmax())
        ratio = _exact_ratio(difference.value(index), scale.value(index))
        if ratio > self.max_rel[0]:
            self.max_rel = (ratio, self.offset + index)
        if bound is not None:
            allowed = bound > 0
            if bool(allowed.any()):
                ratio = float((diff[allowed] / bound[allowed]).max())
                self.max_ratio = max(self.max_ratio, ratio)
        elif self.atol > 0:
            self.max_ratio = max(self.max_ratio, float(diff.max()) / self.atol)
        self.diff_squares += float(diff.square().sum())
        self.expected_squares += float(magnitude.square().sum())

        if chunk_bad:
            self.count_failing_rows(bad.view(-1, self.row_length).any(dim=1))
            self._track_worst_exact(bad, difference, a, e)
        self.offset += count

    def _update_equal(self, values: ExactIntegers) -> None:
        """What :meth:`update` does with a chunk whose actual and expected ``values`` are
        equal: every difference is 0, at index 0 first, and only ``|e|``'s squares add up."""
        if self.max_abs[0] < 0:
            first = values.value(0)
            self.max_abs = (0, self.offset, first, first, self._allowed(first))
        if self.max_rel[0] < 0:
            self.max_rel = (0.0, self.offset)
        if self.atol > 0 or (self.rtol > 0 and bool(values.nonzero_mask().any())):
            self.max_ratio = max(self.max_ratio, 0.0)  # 0 of a bound above 0
        # |e| rounds to float64 as e does, but for its sign: the squares are the same
        self.expected_squares += float(values.as_float64().square().sum())
        self.offset += values.high.numel()

    def _beyond(
        self,
        difference: ExactIntegers,
        scale: ExactIntegers,
        diff: torch.Tensor,
        magnitude: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where ``|a - e| > atol + rtol * |e|``, exactly; and the bounds in float64 (None when
        they are all ``atol``)."""
        if self.rtol == 0:  # an integer is beyond atol exactly when it is beyond floor(atol)
            return difference.greater_than(min(math.floor(self.atol), 2**66)), None
        bound = magnitude.mul(self.rtol).add_(self.atol)
        # float64 errs by a few units in the 53rd bit on both sides; 2**-48 leaves a margin.
        slack = bound.mul(2.0**-48)
        bad = diff > bound + slack
        unsure = (diff >= bound - slack) & ~bad & difference.nonzero_mask()
        atol, rtol = Fraction(self.atol), Fraction(self.rtol)
        for index in unsure.nonzero().squeeze(1).tolist():
            bad[index] = difference.value(index) > atol + rtol * scale.value(index)
        return bad, bound

    def _allowed(self, expected: int) -> float:
        """What an element whose expected value is ``expected`` may differ by."""
        return float(Fraction(self.atol) + Fraction(self.rtol) * abs(expected))

    def _track_worst_exact(
        self, bad: torch.Tensor, difference: ExactIntegers, a: ExactIntegers, e: ExactIntegers
    ) -> None:
        """Keep the worst rows, each mismatched row's worst element, ranked exactly."""
        candidates = difference.masked(bad)  # 0 where within tolerance: never a row's worst
        worst, column = candidates.rows(self.row_length).row_max()
        rows = worst.nonzero_mask().nonzero().squeeze(1)
        for row in worst.descending(rows)[:WORST_ROWS].tolist():
            flat = row * self.row_length + int(column[row])
            expected = e.value(flat)
            self.keep_worst((
                worst.value(row), -(self.offset + flat), a.value(flat), expected,
                self._allowed(expected),
            ))  # type: ignore[arg-type]  # fmt: skip
