"""Comparing tensors, chunk by chunk, into plain data (``maskln diff`` and ``maskln verify``).

An element passes when ``|actual - expected| <= atol + rtol * |expected|`` (computed in float64);
NaN matches NaN only at the same position, and inf matches only the same inf. Integers and bool
are compared exactly instead, in their own values (:class:`IntegerComparison`): float64 cannot
tell ``2**53 + 1`` from ``2**53``. A :class:`Comparison` is fed consecutive chunks of whole rows
and keeps only running figures, so multi-GB tensors compare in bounded memory. :func:`diff_files`
compares two files key by key; :mod:`maskln_cli.verify` feeds recomputed chunks. Rendering is
:mod:`maskln_cli.report`'s job.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from maskln_cli.errors import MasklnError
from maskln_cli.tensorfile import TensorFile, TensorInfo, open_tensor_file, torch_dtype
from maskln_cli.tensorfile import dtype_name as _dtype_name
from maskln_cli.threads import map_blocks

if TYPE_CHECKING:
    import torch

    from maskln_cli.validrows import RowMask

    Allowances = Callable[..., dict[str, torch.Tensor]]
    """``allowance_of(rows)``: the allowance pieces (``allowance``, and ``budget_unit`` and
    ``always`` when budgeted) of some rows of a block (None: all), as
    :meth:`Comparison.update` takes them; ``allowance_of(rows, later=True)``: a function of
    no argument making them later, holding copies of just those rows."""

# (rtol, atol) by dtype, as torch.testing.assert_close has them; other dtypes must be equal.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-7),
    "float32": (1.3e-6, 1e-5),
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
}
WORST_ROWS = 5
"""How many of the worst rows a comparison keeps for the report."""
CHUNK_ELEMENTS = 1 << 22
"""Elements compared at a time (rounded to whole rows): a few float64 temporaries of 32 MiB."""
INTEGRAL_DTYPES = frozenset(
    ("bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64")
)
"""The dtypes compared exactly, in their own values (:class:`IntegerComparison`)."""
LOW_BITS = 2**32 - 1
BLOCK_ELEMENTS = 1 << 18
"""Elements of a block of the fast path (whole rows, at least two). Its float64 temporaries of
2 MiB stay in cache (32 MiB ones stream through memory on every pass), and a block is large
enough that the Python between its torch calls, about a millisecond a block and run holding
the GIL, leaves two workers time to compute side by side. ``maskln verify`` of a 512 MiB x on
2 cores took 7.2 s with blocks of 2**16 elements (as long as on one thread), 5.4 s with 2**17,
4.7 s with 2**18, 5.3 s with 2**19. The figures are the same bits whatever the block size."""

PICKED_FIRST = 8
"""Rows of a block judged first when no ratio found so far rules out most (see
:meth:`Comparison._rows_to_judge`)."""
PICKED_SHARE = 4
"""When more than one row in this many needs its allowances, every row of the block gets
them: gathering the rows would cost more than it saves."""


@functools.cache
def converts_to_float64(dtype: torch.dtype | None) -> bool:
    """Whether values of ``dtype`` can be compared as float64 (not complex, not float4).

    Example:
        >>> import torch
        >>> converts_to_float64(torch.bfloat16), converts_to_float64(torch.complex64)
        (True, False)
    """
    import torch

    if dtype is None or dtype.is_complex:
        return False
    try:
        torch.zeros(1, dtype=dtype).double()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def has_values(dtype: str) -> bool:
    """Whether a tensor of ``dtype`` (a name from :data:`~maskln_cli.tensorfile.DTYPE_NAMES`, or
    a safetensors code torch has no dtype for) has values maskln can read: not complex, F4
    (float4_e2m1fn_x2 in torch, two values a byte) or F6; those are compared bit for bit.

    Example:
        >>> has_values("float8_e4m3fn"), has_values("F6_E2M3"), has_values("complex64")
        (True, False, False)
    """
    return dtype == "bool" or converts_to_float64(torch_dtype(dtype))


def default_tolerance(*dtypes: str) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing these dtypes: the loosest of their defaults.

    Example:
        >>> default_tolerance("float32"), default_tolerance("float32", "bfloat16")
        ((1.3e-06, 1e-05), (0.016, 1e-05))
    """
    pairs = [DEFAULT_TOLERANCES.get(d, (0.0, 0.0)) for d in dtypes]
    return max(r for r, _ in pairs), max(a for _, a in pairs)


RECORDED_ROWS = 4096
"""How many failing rows a comparison remembers (by index), for a diagnosis afterwards."""


def plain_data(value: object) -> object:
    """``value`` as plain data, as :func:`dataclasses.asdict` makes it (dataclasses as dicts of
    their fields, lists, tuples and dicts copied, all the way down), several times faster:
    asdict deep-copies every number, which is most of the time ``diff --json`` spends on a
    file of many tiny tensors.

    Example:
        >>> plain_data(WorstRow([1], [1, 2], 3.0, 4, 1))
        {'row': [1], 'index': [1, 2], 'actual': 3.0, 'expected': 4, 'abs_diff': 1, 'allowed': None}
    """
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is list:
        return [plain_data(v) for v in value]  # type: ignore[attr-defined]
    if kind is dict:
        return {plain_data(k): plain_data(v) for k, v in value.items()}  # type: ignore[attr-defined]
    if is_dataclass(value) and not isinstance(value, type):
        document = {name: getattr(value, name) for name in _field_names(kind)}
        for name, item in document.items():
            if type(item) not in _SCALARS:
                document[name] = plain_data(item)
        return document
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple: as asdict
        return kind(*(plain_data(v) for v in value))
    if isinstance(value, list | tuple):
        return kind(plain_data(v) for v in value)  # type: ignore[call-arg]
    if isinstance(value, dict):
        return kind((plain_data(k), plain_data(v)) for k, v in value.items())  # type: ignore[call-arg]
    return copy.deepcopy(value)


_SCALARS = frozenset((int, float, str, bool, type(None)))


@functools.cache
def _field_names(kind: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(kind))


@dataclass
class WorstRow:
    """A mismatched row: its leading index, the channel of its worst element, both values, and
    what that element was allowed to differ by (``allowed``: the tolerance or the budget)."""

    row: list[int]
    index: list[int]
    actual: float | int
    expected: float | int
    abs_diff: float | int
    allowed: float | None = None


@dataclass
class RowErrors:
    """The relative error ``||a - e|| / ||e||`` of each valid row (rows whose expected values
    are finite and not all 0): how many, their mean and spread, the smallest and the largest.
    A formula mistake errs about the same on every row; rounding does not."""

    rows: int
    mean: float
    std: float
    min: float
    max: float


@dataclass
class BlockFigures:
    """What :meth:`Comparison.measure` finds in a block of whole rows with finite values: the
    per-row figures, and the elementwise maxima with their indices into the block."""

    rows: int
    counts: torch.Tensor | None  # elements beyond their allowance, per row (None: none)
    max_abs: tuple[float, int, float, float, float]  # value, index, actual, expected, allowed
    max_rel: tuple[float, int]
    max_ratio: float
    factor_needed: float
    row_squares: torch.Tensor
    row_norms: torch.Tensor
    # Rows with an element beyond: row, score, index, actual, expected, allowed (tensors).
    worst: tuple[torch.Tensor, ...] | None = None
    yardstick_max: float = -1.0
    yardstick_rows: torch.Tensor | None = None
    padding: tuple[bool, int] | None = None  # invalid rows: all exactly 0, how many -0.0
    # The allowance of the greatest difference when max_abs leaves it out (NaN): made only
    # if this block's greatest difference is reported.
    allowed_later: Callable[[], float] | None = None


@dataclass
class TensorComparison:
    """The outcome for one key. ``problems`` says in words why it failed (empty if it passed).

    Value figures are ``None`` when the values could not be compared (a key missing on one side,
    or shapes that differ). Indices are lists of ints into the tensor; ``max_rel_diff`` is
    ``inf`` when the largest relative difference is at an expected 0. For integer and bool
    tensors ``max_abs_diff`` and the values in ``worst`` are exact Python ints.
    """

    name: str
    passed: bool
    problems: list[str]
    shape: list[int] | None
    expected_shape: list[int] | None
    dtype: str | None
    expected_dtype: str | None
    rtol: float
    atol: float
    numel: int | None = None
    rows: int | None = None
    mismatched: int | None = None
    mismatched_fraction: float | None = None
    mismatched_rows: int | None = None
    max_abs_diff: float | int | None = None
    max_abs_index: list[int] | None = None
    max_rel_diff: float | None = None
    max_rel_index: list[int] | None = None
    rel_l2: float | None = None
    nan_mismatched: int | None = None
    inf_mismatched: int | None = None
    invalid_rows_zero: bool | None = None
    worst: list[WorstRow] = field(default_factory=list)
    rows_left_out: int | None = None
    """Rows a ``--valid`` mask left out of the comparison (None: no mask applied)."""
    budget_ratio: float | None = None
    yardstick_max_abs_diff: float | None = None
    yardstick_rel_l2: float | None = None
    nan_where_finite: int | None = None
    inf_where_finite: int | None = None
    mismatched_invalid_rows: int | None = None
    negative_zeros: int | None = None
    row_rel_error: RowErrors | None = None
    factor_needed: float | None = None
    diagnosis: list[dict[str, object]] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return plain_data(self)  # type: ignore[return-value]


@dataclass
class ComparisonReport:
    """A whole comparison: every key's outcome and notes (such as gradients not checked)."""

    command: str
    actual: str
    expected: str
    tensors: list[TensorComparison]
    notes: list[str] = field(default_factory=list)
    context: dict[str, object] = field(default_factory=dict)
    """What the comparison was made with, for ``verify``: eps and its source, rows, dtypes,
    the tolerance mode (see :mod:`maskln_cli.verify`); JSON carries it at the top level."""

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.tensors)

    def to_dict(self) -> dict[str, object]:
        document: dict[str, object] = {
            "passed": self.passed,
            "command": self.command,
            "actual": self.actual,
            "expected": self.expected,
            **self.context,
            "tensors": [t.to_dict() for t in self.tensors],
            "notes": list(self.notes),
        }
        return document


class Comparison:
    """Running comparison of one tensor, fed consecutive chunks of whole rows.

    By default an element passes within ``atol + rtol * |expected|`` (``maskln diff``);
    :meth:`update` can instead be given each element's allowance (``maskln verify``'s error
    budget), a yardstick to measure against the same expected values, and the rows whose
    actual values must be exactly 0.

    Example:
        >>> import torch
        >>> comparison = Comparison("out", [2, 2], "float32", [2, 2], "float32")
        >>> comparison.update(torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 2.0]]))
        >>> comparison.update(torch.tensor([[3.0, 4.5]]), torch.tensor([[3.0, 4.0]]))
        >>> result = comparison.result()
        >>> result.passed, result.mismatched, result.max_abs_diff, result.max_abs_index
        (False, 1, 0.5, [1, 1])
    """

    def __init__(
        self,
        name: str,
        shape: Sequence[int],
        dtype: str,
        expected_shape: Sequence[int],
        expected_dtype: str,
        rtol: float | None = None,
        atol: float | None = None,
        rank_by_ratio: bool = False,
        same_dtype: bool = True,
    ) -> None:
        default_rtol, default_atol = default_tolerance(dtype, expected_dtype)
        self.name = name
        self.shape = list(shape)
        self.expected_shape = list(expected_shape)
        self.dtype = dtype
        self.expected_dtype = expected_dtype
        self._float64_forms = all(
            converts_to_float64(torch_dtype(d)) for d in (dtype, expected_dtype)
        )
        # Floating dtypes on both sides take the fast path of measure() and merge().
        self._fast = all(
            (t := torch_dtype(d)) is not None and t.is_floating_point
            for d in (dtype, expected_dtype)
        )
        self.rtol = default_rtol if rtol is None else rtol
        self.atol = default_atol if atol is None else atol
        # Worst rows by how far beyond their allowance (verify's budgets differ by element),
        # or by absolute difference (one tolerance for every element).
        self.rank_by_ratio = rank_by_ratio
        # A dtype difference is a problem (diff), or by design (verify: float64 reference).
        self.same_dtype = same_dtype
        # Rows are the leading index; a tensor of rank 0 or 1 has one element per row.
        self.row_length = self.shape[-1] if len(self.shape) >= 2 else 1
        self.numel = math.prod(self.shape)
        self._offset = 0
        self._mismatched = 0
        self._mismatched_rows = 0
        self._nan_mismatched = 0
        self._inf_mismatched = 0
        self._nan_where_finite = 0
        self._inf_where_finite = 0
        self._max_abs = (-1.0, -1, math.nan, math.nan, math.nan)
        self._max_rel = (-1.0, -1)
        self._max_ratio = -1.0
        self._factor_needed = 0.0
        self._diff_squares = 0.0
        self._expected_squares = 0.0
        self._yardstick_max = -1.0
        self._yardstick_squares = 0.0
        self._invalid_rows_zero: bool | None = None
        self._mismatched_invalid_rows: int | None = None
        self._negative_zeros: int | None = None
        # Per valid row, the relative error: count, sum, sum of squares, min, max.
        self._row_errors = [0, 0.0, 0.0, math.inf, 0.0]
        self.yardstick_row_error_sum = 0.0
        self.failing_rows: list[int] = []
        """Indices of the first :data:`RECORDED_ROWS` failing rows (for a diagnosis)."""
        self.beyond = 0
        """Mismatched elements with finite values on both sides (beyond their allowance)."""
        self.beyond_in_invalid_rows = 0
        self.nonfinite_in_invalid_rows = 0
        """Mismatched elements in the rows marked invalid: finite, and NaN or inf."""
        # Heap of (score, -flat index, actual, expected, allowed): the worst rows so far.
        self._worst: list[tuple[float, int, float, float, float]] = []

    @property
    def same_shape(self) -> bool:
        return self.shape == self.expected_shape

    @property
    def comparable(self) -> bool:
        """Values can be compared (fed to :meth:`update`) when the shapes agree and both dtypes
        have a float64 form (see :func:`converts_to_float64`)."""
        return self.same_shape and self._float64_forms

    def chunk_rows(self) -> int:
        """Rows per chunk for :meth:`update`, about :data:`CHUNK_ELEMENTS` elements."""
        return max(1, CHUNK_ELEMENTS // max(1, self.row_length))

    def update(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        invalid_rows: torch.Tensor | None = None,
        allowance: torch.Tensor | None = None,
        yardstick: torch.Tensor | None = None,
        budget_unit: torch.Tensor | None = None,
        always: torch.Tensor | None = None,
    ) -> None:
        """Compare the next chunk of rows.

        ``invalid_rows`` (bool, one per row) marks rows whose actual values must be exactly 0
        (masked layer-norm outputs); they are counted apart, and so are the -0.0 in them.
        ``allowance`` (one per element) replaces ``atol + rtol * |expected|``; ``yardstick``
        (one per element) is another result measured against the same expected values. With
        either, an actual inf where expected is beyond the actual dtype's range (so rounds to
        that inf) passes. ``budget_unit`` and ``always`` (one per element) are how the
        allowance was made, ``max(factor * unit, always)``: the factor each element needed is
        tracked (see :meth:`factor_needed`).
        """
        a = actual.detach().reshape(-1)
        e = expected.detach().reshape(-1)
        if a.numel() != e.numel() or a.numel() % self.row_length:
            raise ValueError("chunks must hold the same whole rows of both tensors")
        pieces = (allowance, yardstick, budget_unit, always)
        blocks = self._block_ranges(a.numel())
        if blocks:
            flat = [None if t is None else t.detach().reshape(-1) for t in pieces]
            invalid = None if invalid_rows is None else invalid_rows.reshape(-1)
            length = self.row_length

            def one(block: tuple[int, int]) -> BlockFigures | None:
                start, stop = block[0] * length, block[1] * length
                part = [None if t is None else t[start:stop] for t in flat]
                rows = None if invalid is None else invalid[block[0] : block[1]]
                return self.measure(a[start:stop], e[start:stop], rows, *part)

            measured = map_blocks(one, blocks)
            if all(b is not None for b in measured):
                self.merge(measured, invalid)  # type: ignore[arg-type]
                return
        self._update_general(actual, expected, invalid_rows, *pieces)

    def _block_ranges(self, numel: int) -> list[tuple[int, int]]:
        """Blocks of whole rows (two or more, see :func:`maskln_cli.core.row_blocks`) of about
        :data:`BLOCK_ELEMENTS`; none when the chunk is empty or a dtype has no fast path."""
        if not numel or not self._fast:
            return []
        from maskln_cli.core import row_blocks

        rows = numel // self.row_length
        return list(row_blocks(rows, max(2, BLOCK_ELEMENTS // self.row_length)))

    def measure(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        invalid_rows: torch.Tensor | None = None,
        allowance: torch.Tensor | None = None,
        yardstick: torch.Tensor | None = None,
        budget_unit: torch.Tensor | None = None,
        always: torch.Tensor | None = None,
        yardstick_error: torch.Tensor | None = None,
        allowance_of: Allowances | None = None,
        lower: float = 0.0,
    ) -> BlockFigures | None:
        """The figures of one block of whole rows, as :meth:`update` takes it, for
        :meth:`merge`; None when a value is NaN or inf (the general path then compares the
        chunk). Reads no running figure but the greatest ratio merged so far, so blocks of a
        chunk can be measured on several threads before it is merged.

        The float64 values and operations are those of the general path, element by element
        and row by row, so every figure is the same bit for bit; only work whose outcome is
        known is skipped (no NaN or inf to mask, no element beyond when no ratio reaches 1).
        ``yardstick_error`` is ``|yardstick - expected|`` in float64 when the caller has it.

        ``allowance_of`` (instead of ``allowance``, ``budget_unit`` and ``always``) makes
        those pieces for the rows it is given (None: every row), as :meth:`update` takes them;
        ``lower`` is at most every allowance and every ``always`` of a valid row (invalid rows
        are allowed nothing). Then only rows where an element could be beyond its allowance,
        or beyond what is always allowed, or could hold the greatest ratio, get their
        allowances: see :meth:`_rows_to_judge`.
        """
        import torch

        length = self.row_length
        rows = actual.numel() // length
        a = actual.detach().reshape(-1)
        a64 = a.double()
        e64 = expected.detach().reshape(-1).double()  # may be expected itself: never written
        diff = torch.sub(a64, e64).abs_()
        # The greatest difference and its first index, row by row: a third of the time of
        # diff.max(dim=0), which finds the same (torch returns the first of equal maxima).
        row_max = diff.view(rows, length).amax(dim=1)
        value, row = row_max.max(dim=0)
        # NaN or inf on either side makes the difference NaN or inf, and so its maximum.
        if not math.isfinite(float(value)):
            return None
        row = int(row)
        i = row * length + int(diff.view(rows, length)[row].max(dim=0).indices)
        e_abs = e64.abs()  # then a buffer for more of the same size
        if allowance_of is not None:
            invalid = None if invalid_rows is None else invalid_rows.reshape(-1)
            judged = self._judge_rows(
                diff, row_max, a64, e64, invalid, allowance_of, lower, i, rows
            )
        else:
            if allowance is None:
                bound = torch.mul(e_abs, self.rtol).add_(self.atol)
                positive = self.atol > 0  # then bound >= atol everywhere
            else:
                bound = allowance.detach().reshape(-1).double()
                positive = bool(bound.amin() > 0)  # False on NaN
            judged = self._judge(diff, bound, positive, a64, e64, rows, budget_unit, always)
            if judged is not None:
                judged = (*judged, float(bound[i]), None)
        if judged is None:
            return None
        counts, max_ratio, factor, worst, allowed, allowed_later = judged
        max_abs = (float(value), i, float(a64[i]), float(e64[i]), allowed)
        relative = torch.div(diff, e_abs, out=e_abs).nan_to_num_(nan=0.0, posinf=math.inf)
        value, index = relative.max(dim=0)
        max_rel = (float(value), int(index))
        # The squares in place: the differences are no longer needed, nor the buffer.
        row_squares = diff.square_().view(rows, length).sum(dim=1)
        # Finite differences may still square to inf: the general path then counts them.
        if not math.isfinite(float(row_squares.sum())):
            return None
        row_norms = torch.square(e64, out=e_abs).view(rows, length).sum(dim=1)
        block = BlockFigures(
            rows, counts, max_abs, max_rel, max_ratio, factor, row_squares, row_norms, worst,
            allowed_later=allowed_later,
        )  # fmt: skip
        if yardstick is not None:
            if yardstick_error is None:
                y_diff = torch.sub(yardstick.detach().reshape(-1).double(), e64).abs_()
            else:
                y_diff = yardstick_error.reshape(-1)
            y_rows = torch.square(y_diff, out=e_abs).view(rows, length).sum(dim=1)
            if not math.isfinite(float(y_rows.sum())) and not bool(y_diff.isfinite().all()):
                y = yardstick.detach().reshape(-1).double()
                y_diff = torch.where(y.isfinite(), y_diff, 0.0)
                y_rows = y_diff.view(rows, length).square().sum(dim=1)
            block.yardstick_max, block.yardstick_rows = float(y_diff.amax()), y_rows
        if invalid_rows is not None:
            invalid = invalid_rows.reshape(-1)
            if bool(invalid.any()):
                # In float64, exact for every dtype: float8 has no signbit, and e8m0 has no 0
                # (its byte 0 is 2**-127), nor fnuz types a -0 (their 0x80 is NaN).
                padded = a64.view(rows, length)[invalid]
                zeros = padded == 0
                block.padding = (bool(zeros.all()), int((zeros & padded.signbit()).sum()))
        return block

    def _judge(
        self,
        diff: torch.Tensor,
        bound: torch.Tensor,
        positive: bool,
        a64: torch.Tensor,
        e64: torch.Tensor,
        rows: int,
        budget_unit: torch.Tensor | None,
        always: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, float, float, tuple[torch.Tensor, ...] | None] | None:
        """The figures of a block that depend on each element's allowance ``bound``: elements
        beyond it per row (None: none), the greatest ratio, the factor needed, and the worst
        element of each row with one beyond (indices into the block). None on a NaN factor."""
        import torch

        length = self.row_length
        ratio = torch.div(diff, bound)
        if positive:  # no 0/0: the ratio has no NaN to mask
            max_ratio = float(ratio.max())
            # diff > bound > 0 makes the ratio 1 or more, even rounded.
            bad = diff > bound if max_ratio >= 1 else None
        else:
            ratio.nan_to_num_(nan=0.0, posinf=math.inf)
            max_ratio = float(torch.where(bound > 0, ratio, 0.0).max())
            bad = diff > bound
        counts = bad.view(rows, length).sum(dim=1) if bad is not None else None
        if counts is not None and not bool(counts.any()):
            counts = None
        factor = 0.0
        if budget_unit is not None and always is not None:
            beyond = diff > always.reshape(-1)
            if bool(beyond.any()):
                factor = float(torch.where(beyond, diff / budget_unit.reshape(-1), 0.0).max())
                if math.isnan(factor):
                    return None
        worst = None
        if counts is not None and bad is not None:
            bad_rows = (counts > 0).nonzero().squeeze(1)
            measure = (ratio if self.rank_by_ratio else diff).view(rows, length)[bad_rows]
            inside = bad.view(rows, length)[bad_rows]
            score, channel = torch.where(inside, measure, -1.0).max(dim=1)
            flat = bad_rows * length + channel
            worst = (bad_rows, score, flat, a64[flat], e64[flat], bound[flat])
        return counts, max_ratio, factor, worst

    def _judge_rows(
        self,
        diff: torch.Tensor,
        row_max: torch.Tensor,
        a64: torch.Tensor,
        e64: torch.Tensor,
        invalid: torch.Tensor | None,
        allowance_of: Allowances,
        lower: float,
        top: int,
        rows: int,
    ) -> tuple | None:
        """:meth:`_judge` on the rows :meth:`_rows_to_judge` picks, their allowances made by
        ``allowance_of``; the figures of the rows left out are known without them. Then the
        allowance of element ``top`` (the greatest difference), or NaN and how to make it."""
        import torch

        length = self.row_length
        top_row, channel = divmod(top, length)
        picked = self._rows_to_judge(
            diff, row_max, a64, e64, invalid, allowance_of, lower, top_row, rows
        )
        if picked is None:  # every row: nothing to gather
            pieces = {k: v.reshape(-1).double() for k, v in allowance_of(None).items()}
            bound = pieces["allowance"]
            judged = self._judge(
                diff, bound, bool(bound.amin() > 0), a64, e64, rows,
                pieces.get("budget_unit"), pieces.get("always"),
            )  # fmt: skip
            return None if judged is None else (*judged, float(bound[top]), None)
        if not picked.numel():
            # No element beyond anything, no ratio above one already merged (so -1 here):
            # only the greatest difference's allowance may be reported, made if it is.
            pair = sorted({top_row, 1 if top_row == 0 else 0})
            at = pair.index(top_row) * length + channel
            later = allowance_of(torch.tensor(pair), later=True)

            def allowed() -> float:
                return float(later()["allowance"].reshape(-1)[at])

            return None, -1.0, 0.0, None, math.nan, allowed
        part = self._judge_picked(picked, diff, a64, e64, allowance_of)
        if part is None:
            return None
        (counts, max_ratio, factor, worst), bound = part
        if counts is not None:
            counts = torch.zeros(rows, dtype=counts.dtype).index_copy_(0, picked, counts)
        if worst is not None:
            bad_rows, score, flat, *values = worst
            channels = flat - bad_rows * length
            bad_rows = picked[bad_rows]
            worst = (bad_rows, score, bad_rows * length + channels, *values)
        # The row of the greatest difference among those picked (sorted).
        at = int(torch.searchsorted(picked, top_row))
        return counts, max_ratio, factor, worst, float(bound[at * length + channel]), None

    def _judge_picked(
        self,
        picked: torch.Tensor,
        diff: torch.Tensor,
        a64: torch.Tensor,
        e64: torch.Tensor,
        allowance_of: Allowances,
    ) -> tuple[tuple, torch.Tensor] | None:
        """:meth:`_judge` of rows ``picked`` (sorted indices), and their allowances."""
        length = self.row_length
        count = picked.numel()

        def gather(t: torch.Tensor) -> torch.Tensor:
            return t.view(-1, length).index_select(0, picked).reshape(-1)

        pieces = {k: v.reshape(-1).double() for k, v in allowance_of(picked).items()}
        bound = pieces["allowance"]
        judged = self._judge(
            gather(diff), bound, bool(bound.amin() > 0), gather(a64), gather(e64), count,
            pieces.get("budget_unit"), pieces.get("always"),
        )  # fmt: skip
        return None if judged is None else (judged, bound)

    def _rows_to_judge(
        self,
        diff: torch.Tensor,
        row_max: torch.Tensor,
        a64: torch.Tensor,
        e64: torch.Tensor,
        invalid: torch.Tensor | None,
        allowance_of: Allowances,
        lower: float,
        top_row: int,
        rows: int,
    ) -> torch.Tensor | None:
        """The rows (sorted indices, two or more: torch sums a lone row differently) whose
        allowances :meth:`measure` needs; None for all of them, none (empty) when only the
        greatest difference's allowance (in row ``top_row``) may be needed. ``row_max`` is
        each row's greatest difference.

        A valid row's elements are each allowed ``lower`` or more, so a row whose greatest
        difference ``d`` is at most ``lower`` has no element beyond (nor beyond what is always
        allowed), and no ratio above ``d / lower`` (rounding is monotonic). So only rows where
        ``d / lower`` reaches 1 (as it does when ``d > lower``), or exceeds a ratio already
        found (in this block, or merged from earlier chunks), can change a figure; and
        invalid rows (allowed nothing) that are not all 0.
        """
        import torch

        if lower <= 0 or rows <= 2:
            return None
        # inf for an invalid row that is not all 0, NaN (never picked) for one that is.
        lows = torch.where(invalid, 0.0, lower) if invalid is not None else lower
        ceiling = torch.div(row_max, lows)  # >= every ratio of a valid row
        known = self._max_ratio

        def pick(known: float) -> torch.Tensor:
            return ceiling > known if known < 1 else ceiling >= 1

        picked = pick(known)
        count = int(picked.sum())
        if count > PICKED_FIRST:
            # Without a ratio as great as this block's yet, judge its likeliest rows first
            # (and again with the rest: the greatest ratio is then among those judged).
            first = ceiling.nan_to_num(nan=-1.0).topk(PICKED_FIRST).indices.sort().values
            part = self._judge_picked(first, diff, a64, e64, allowance_of)
            if part is not None and part[0][1] > known:
                picked = pick(part[0][1])
                picked[first] = True
                count = int(picked.sum())
        if count * PICKED_SHARE > rows:
            return None
        if count:
            picked[top_row] = True
            if count == 1:
                picked[1 if top_row == 0 else 0] = True
        return picked.nonzero().squeeze(1)

    def merge(
        self, blocks: Sequence[BlockFigures], invalid_rows: torch.Tensor | None = None
    ) -> None:
        """Add the figures of consecutive blocks making up one chunk (``invalid_rows``: one flag
        per row of the chunk), as :meth:`update` of the whole chunk would: sums over rows are
        taken over the whole chunk's rows, in one call, as the general path takes them."""
        import torch

        length = self.row_length
        first_row = self._offset // length
        starts, total = [], 0
        for block in blocks:
            starts.append(total)
            total += block.rows * length
        # The first block with the greatest value: where one max over the chunk finds it.
        top_abs = top_rel = top_block = None
        for block, start in zip(blocks, starts, strict=True):
            if top_abs is None or block.max_abs[0] > top_abs[0]:
                top_abs = (block.max_abs[0], start + block.max_abs[1], *block.max_abs[2:])
                top_block = block
            if top_rel is None or block.max_rel[0] > top_rel[0]:
                top_rel = (block.max_rel[0], start + block.max_rel[1])
        if top_abs is None or top_rel is None:
            return
        if top_abs[0] > self._max_abs[0]:
            if top_block is not None and top_block.allowed_later is not None:
                top_abs = (*top_abs[:4], top_block.allowed_later())
            self._max_abs = (top_abs[0], self._offset + top_abs[1], *top_abs[2:])  # type: ignore[assignment]
        if top_rel[0] > self._max_rel[0]:
            self._max_rel = (top_rel[0], self._offset + top_rel[1])
        self._max_ratio = max(self._max_ratio, max(b.max_ratio for b in blocks))
        self._factor_needed = max(self._factor_needed, max(b.factor_needed for b in blocks))
        row_squares = torch.cat([b.row_squares for b in blocks])
        self._diff_squares += float(row_squares.sum())
        row_norms = torch.cat([b.row_norms for b in blocks])
        self._expected_squares += float(row_norms.sum())
        counts = None
        if any(b.counts is not None for b in blocks):
            counts = torch.cat([
                b.counts if b.counts is not None else torch.zeros(b.rows, dtype=torch.long)
                for b in blocks
            ])  # fmt: skip
        chunk_bad = int(counts.sum()) if counts is not None else 0
        self._mismatched += chunk_bad
        self.beyond += chunk_bad
        rows_bad = counts > 0 if counts is not None else None
        if rows_bad is not None:
            self._mismatched_rows += int(rows_bad.sum())
            if len(self.failing_rows) < RECORDED_ROWS:
                more = rows_bad.nonzero().squeeze(1)[: RECORDED_ROWS - len(self.failing_rows)]
                self.failing_rows += (more + first_row).tolist()
            self._merge_worst(blocks, starts)
        yardstick_rows = None
        if blocks[0].yardstick_rows is not None:
            self._yardstick_max = max(self._yardstick_max, max(b.yardstick_max for b in blocks))
            yardstick_rows = torch.cat([b.yardstick_rows for b in blocks])  # type: ignore[misc]
            self._yardstick_squares += float(yardstick_rows.sum())
        if invalid_rows is not None:
            invalid = invalid_rows.reshape(-1)
            if rows_bad is not None:
                self._mismatched_invalid_rows = (self._mismatched_invalid_rows or 0) + int(
                    (rows_bad & invalid).sum()
                )
                if counts is not None:
                    self.beyond_in_invalid_rows += int(counts[invalid].sum())
            elif self._mismatched_invalid_rows is None:
                self._mismatched_invalid_rows = 0
            padding = [b.padding for b in blocks if b.padding is not None]
            if padding:
                zero = all(z for z, _ in padding)
                self._invalid_rows_zero = zero and self._invalid_rows_zero is not False
                self._negative_zeros = (self._negative_zeros or 0) + sum(n for _, n in padding)
            elif self._negative_zeros is None:
                self._negative_zeros = 0
            usable = ~invalid & (row_norms > 0)
            self._track_row_errors(usable, row_squares, row_norms, yardstick_rows)
        self._offset += total

    def _merge_worst(self, blocks: Sequence[BlockFigures], starts: Sequence[int]) -> None:
        """The chunk's worst rows from its blocks' candidates, as :meth:`_track_worst` does."""
        import torch

        found = [
            (b.worst, start) for b, start in zip(blocks, starts, strict=True) if b.worst is not None
        ]
        if not found:
            return
        score = torch.cat([w[1] for w, _ in found])
        flat = torch.cat([w[2] + start for w, start in found])
        actual, expected, allowed = (torch.cat([w[k] for w, _ in found]) for k in (3, 4, 5))
        # Stable sort: among equal scores the earliest rows win, whatever the chunking.
        order = score.sort(descending=True, stable=True).indices[:WORST_ROWS]
        for k in order.tolist():
            entry = (
                float(score[k]), -(self._offset + int(flat[k])), float(actual[k]),
                float(expected[k]), float(allowed[k]),
            )  # fmt: skip
            if len(self._worst) < WORST_ROWS:
                heapq.heappush(self._worst, entry)
            else:
                heapq.heappushpop(self._worst, entry)

    def _update_general(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        invalid_rows: torch.Tensor | None = None,
        allowance: torch.Tensor | None = None,
        yardstick: torch.Tensor | None = None,
        budget_unit: torch.Tensor | None = None,
        always: torch.Tensor | None = None,
    ) -> None:
        """:meth:`update` for any values, NaN and inf included, on the whole chunk in float64
        (the definition the fast path of :meth:`measure` and :meth:`merge` reproduces)."""
        import torch

        a = actual.detach().reshape(-1).double()
        e = expected.detach().reshape(-1).double()
        if a.numel() != e.numel() or a.numel() % self.row_length:
            raise ValueError("chunks must hold the same whole rows of both tensors")
        length = self.row_length
        a_finite, e_finite = a.isfinite(), e.isfinite()
        finite = a_finite & e_finite
        clean = bool(finite.all())  # the usual case: no NaN or inf to account for
        diff = (a - e).abs_()
        if allowance is None:
            bound = e.abs().mul_(self.rtol).add_(self.atol)
        else:
            bound = allowance.detach().reshape(-1).double()
        if clean:
            bad = diff > bound
        else:
            diff = torch.where(finite, diff, 0.0)
            a_nan, e_nan = a.isnan(), e.isnan()
            same = (a == e) | (a_nan & e_nan)  # covers equal infs, and NaN at the same place
            overflowed = a.isinf() & e_finite
            if allowance is not None and bool(overflowed.any()):
                rounded = e.to(torch_dtype(self.dtype) or torch.float64).double()
                same |= overflowed & (rounded == a)
            bad = ~(same | (finite & (diff <= bound)))
            self._nan_mismatched += int((a_nan != e_nan).sum())
            self._inf_mismatched += int(((a.isinf() | e.isinf()) & ~same & ~(a_nan | e_nan)).sum())
            self._nan_where_finite += int((a_nan & e_finite).sum())
            self._inf_where_finite += int((overflowed & ~same).sum())
        chunk_bad = int(bad.sum())
        self._mismatched += chunk_bad
        self.beyond += chunk_bad if clean else int((bad & finite).sum())

        self._track_max_abs(diff, a, e, bound)
        # |a - e| / |e|: inf at an expected 0 with a difference, 0 where both are 0
        relative = (diff / e.abs()).nan_to_num_(nan=0.0, posinf=math.inf)
        if relative.numel():
            value, index = relative.max(dim=0)
            if float(value) > self._max_rel[0]:
                self._max_rel = (float(value), self._offset + int(index))
        # How far beyond its allowance each element is (inf where nothing was allowed); the
        # maximum is over elements allowed something: the padding is counted apart.
        ratio = (diff / bound).nan_to_num_(nan=0.0, posinf=math.inf)
        if ratio.numel():
            some = torch.where(bound > 0, ratio, 0.0)
            self._max_ratio = max(self._max_ratio, float(some.max()))
        if budget_unit is not None and always is not None:
            beyond = (diff > always.reshape(-1)) & finite
            if bool(beyond.any()):
                needed = torch.where(beyond, diff / budget_unit.reshape(-1), 0.0)
                self._factor_needed = max(self._factor_needed, float(needed.max()))
        row_squares = diff.view(-1, length).square().sum(dim=1)
        self._diff_squares += float(row_squares.sum())
        clean_e = e if clean or bool(e_finite.all()) else torch.where(e_finite, e, 0.0)
        row_norms = clean_e.view(-1, length).square().sum(dim=1)
        self._expected_squares += float(row_norms.sum())

        first_row = self._offset // length
        rows_bad = bad.view(-1, length).any(dim=1) if chunk_bad else None
        if rows_bad is not None:
            self._mismatched_rows += int(rows_bad.sum())
            if len(self.failing_rows) < RECORDED_ROWS:
                more = rows_bad.nonzero().squeeze(1)[: RECORDED_ROWS - len(self.failing_rows)]
                self.failing_rows += (more + first_row).tolist()
            self._track_worst(bad, finite, diff, ratio, a, e, bound)

        yardstick_rows = None
        if yardstick is not None:
            y = yardstick.detach().reshape(-1).double()
            y_diff = (y - e).abs_()
            if not clean or not bool(y_diff.isfinite().all()):
                y_diff = torch.where(y.isfinite() & e_finite, y_diff, 0.0)
            if y_diff.numel():
                self._yardstick_max = max(self._yardstick_max, float(y_diff.max()))
            yardstick_rows = y_diff.view(-1, length).square().sum(dim=1)
            self._yardstick_squares += float(yardstick_rows.sum())
        if invalid_rows is not None:
            invalid = invalid_rows.reshape(-1)
            self._track_rows(
                invalid, rows_bad, bad, a, finite, row_squares, row_norms, yardstick_rows, clean
            )
        self._offset += a.numel()

    @staticmethod
    def update_many(
        comparisons: Sequence[Comparison], actual: torch.Tensor, expected: torch.Tensor
    ) -> list[bool]:
        """Feed many small tensors at once, row ``k`` of ``actual`` and ``expected`` (2-d,
        ``[len(comparisons), numel]``) being the whole of comparison ``k``'s tensors; return
        which were fed: those whose every element is finite and within tolerance, whose
        figures take a few torch calls for all. Each other comparison is fed nothing, and
        must go through :meth:`update`.

        A tiny tensor's comparison is some 45 torch calls on a handful of elements, 180 us in
        all; ``diff`` of 10,000 such tensors spent most of its time there. Each figure here is
        the one :meth:`update` computes, by the same operations, row by row (a test checks
        them against it); the comparisons must all have the same shape, dtypes, rtol and
        atol, and be fresh.

        Example:
            >>> import torch
            >>> made = [Comparison(n, [2], "float32", [2], "float32") for n in "ab"]
            >>> Comparison.update_many(made, torch.tensor([[1.0, 2.0], [3.0, 4.5]]),
            ...                        torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
            [True, False]
            >>> made[0].result().passed  # made[1] (4.5 against 4.0) must go through update
            True
        """
        import torch

        first = comparisons[0]
        count, length = len(comparisons), first.row_length
        a, e = actual.detach().double(), expected.detach().double()
        diff = (a - e).abs_()
        bound = e.abs().mul_(first.rtol).add_(first.atol)
        fed = (a.isfinite() & e.isfinite() & (diff <= bound)).all(dim=1)
        if not bool(fed.any()):
            return [False] * count
        max_abs, max_abs_index = diff.max(dim=1)
        at = max_abs_index[:, None]
        max_abs_a, max_abs_e, max_abs_bound = (t.gather(1, at)[:, 0] for t in (a, e, bound))
        relative = (diff / e.abs()).nan_to_num_(nan=0.0, posinf=math.inf)
        max_rel, max_rel_index = relative.max(dim=1)
        ratio = (diff / bound).nan_to_num_(nan=0.0, posinf=math.inf)
        max_ratio = torch.where(bound > 0, ratio, 0.0).max(dim=1).values
        diff_squares = diff.view(count, -1, length).square().sum(dim=2).sum(dim=1)
        expected_squares = e.view(count, -1, length).square().sum(dim=2).sum(dim=1)
        columns = zip(
            fed.tolist(), max_abs.tolist(), max_abs_index.tolist(), max_abs_a.tolist(),
            max_abs_e.tolist(), max_abs_bound.tolist(), max_rel.tolist(), max_rel_index.tolist(),
            max_ratio.tolist(), diff_squares.tolist(), expected_squares.tolist(), strict=True,
        )  # fmt: skip
        for comparison, (ok, *figures) in zip(comparisons, columns, strict=True):
            if ok:
                comparison._add_passing(*figures)
        return fed.tolist()

    def _add_passing(
        self,
        max_abs: float,
        max_abs_index: int,
        max_abs_actual: float,
        max_abs_expected: float,
        max_abs_bound: float,
        max_rel: float,
        max_rel_index: int,
        max_ratio: float,
        diff_squares: float,
        expected_squares: float,
    ) -> None:
        """Record a whole tensor compared by :meth:`update_many`: finite, and within
        tolerance everywhere (so no mismatch, no worst row to keep)."""
        if self._offset:
            raise ValueError("update_many takes whole tensors, to comparisons not yet fed")
        self._max_abs = (max_abs, max_abs_index, max_abs_actual, max_abs_expected, max_abs_bound)
        self._max_rel = (max_rel, max_rel_index)
        self._max_ratio = max(self._max_ratio, max_ratio)
        self._diff_squares += diff_squares
        self._expected_squares += expected_squares
        self._offset = self.numel

    def factor_needed(self) -> float:
        """The smallest factor by which the budget units fed to :meth:`update` would let every
        finite element pass (elements within what is always allowed count for nothing)."""
        return self._factor_needed

    def _track_max_abs(
        self, diff: torch.Tensor, a: torch.Tensor, e: torch.Tensor, bound: torch.Tensor
    ) -> None:
        if diff.numel() == 0:
            return
        value, index = diff.max(dim=0)
        if float(value) > self._max_abs[0]:
            i = int(index)
            self._max_abs = (
                float(value),
                self._offset + i,
                float(a[i]),
                float(e[i]),
                float(bound[i]),
            )

    def _track_worst(
        self,
        bad: torch.Tensor,
        finite: torch.Tensor,
        diff: torch.Tensor,
        ratio: torch.Tensor,
        a: torch.Tensor,
        e: torch.Tensor,
        bound: torch.Tensor,
    ) -> None:
        """Keep the worst rows: each mismatched row's worst element, non-finite ones first."""
        import torch

        measure = ratio if self.rank_by_ratio else diff
        score = torch.where(bad, torch.where(finite, measure, math.inf), -1.0)
        row_score, row_channel = score.view(-1, self.row_length).max(dim=1)
        bad_rows = (row_score >= 0).nonzero().squeeze(1)
        if not bad_rows.numel():
            return
        # Stable sort: among equal scores the earliest rows win, whatever the chunking.
        order = row_score[bad_rows].sort(descending=True, stable=True).indices[:WORST_ROWS]
        for row in bad_rows[order].tolist():
            flat = row * self.row_length + int(row_channel[row])
            entry = (
                float(row_score[row]), -(self._offset + flat), float(a[flat]), float(e[flat]),
                float(bound[flat]),
            )  # fmt: skip
            if len(self._worst) < WORST_ROWS:
                heapq.heappush(self._worst, entry)
            else:
                heapq.heappushpop(self._worst, entry)

    def _track_rows(
        self,
        invalid: torch.Tensor,
        rows_bad: torch.Tensor | None,
        bad: torch.Tensor,
        a: torch.Tensor,
        finite: torch.Tensor,
        row_squares: torch.Tensor,
        row_norms: torch.Tensor,
        yardstick_rows: torch.Tensor | None,
        clean: bool,
    ) -> None:
        """Invalid rows: exactly 0 (and which are -0.0); valid rows: each one's relative error."""
        length = self.row_length
        any_invalid = bool(invalid.any())
        if rows_bad is not None:
            self._mismatched_invalid_rows = (self._mismatched_invalid_rows or 0) + int(
                (rows_bad & invalid).sum()
            )
            if any_invalid:
                padded_bad = bad.view(-1, length)[invalid]
                padded_finite = finite.view(-1, length)[invalid]
                self.beyond_in_invalid_rows += int((padded_bad & padded_finite).sum())
                self.nonfinite_in_invalid_rows += int((padded_bad & ~padded_finite).sum())
        elif self._mismatched_invalid_rows is None:
            self._mismatched_invalid_rows = 0
        if any_invalid:
            padded = a.view(-1, length)[invalid]
            zero = bool((padded == 0).all())
            self._invalid_rows_zero = zero and self._invalid_rows_zero is not False
            negative = int(((padded == 0) & padded.signbit()).sum())
            self._negative_zeros = (self._negative_zeros or 0) + negative
        elif self._negative_zeros is None:
            self._negative_zeros = 0
        usable = ~invalid & (row_norms > 0)
        if not clean:
            usable &= finite.view(-1, length).all(dim=1)
        self._track_row_errors(usable, row_squares, row_norms, yardstick_rows)

    def _track_row_errors(
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
        count, total, total_squares, low, high = self._row_errors
        self._row_errors = [
            count + errors.numel(), total + float(errors.sum()),
            total_squares + float(errors.square().sum()), min(low, float(errors.min())),
            max(high, float(errors.max())),
        ]  # fmt: skip
        if yardstick_rows is not None:
            self.yardstick_row_error_sum += float((yardstick_rows[usable] / norms).sqrt_().sum())

    def result(self, extra_problems: Iterable[str] = (), compared: bool = True) -> TensorComparison:
        """The outcome, once every chunk has been fed.

        With ``compared=False`` (or shapes that differ) no values were fed, and the outcome
        holds the shapes, dtypes and problems only.
        """
        problems = list(extra_problems)
        if self.shape != self.expected_shape:
            problem = f"shape {self.shape} vs expected {self.expected_shape}"
            if math.prod(self.expected_shape) == self.numel:
                problem += ": the same number of elements in another shape; values not compared"
            problems.append(problem)
        if self.same_dtype and self.dtype != self.expected_dtype:
            problems.append(f"dtype {self.dtype} vs expected {self.expected_dtype}")
        outcome = TensorComparison(
            name=self.name,
            passed=False,
            problems=problems,
            shape=self.shape,
            expected_shape=self.expected_shape,
            dtype=self.dtype,
            expected_dtype=self.expected_dtype,
            rtol=self.rtol,
            atol=self.atol,
        )
        if not (self.comparable and compared):
            outcome.passed = not problems
            return outcome
        if self._offset != self.numel:
            raise ValueError(f"compared {self._offset} of {self.numel} elements of {self.name!r}")
        rows = self.numel // self.row_length if self.row_length else 0
        outcome.numel = self.numel
        outcome.rows = rows
        outcome.mismatched = self._mismatched
        outcome.mismatched_fraction = float(self._mismatched / self.numel) if self.numel else 0.0
        outcome.mismatched_rows = self._mismatched_rows
        outcome.nan_mismatched = self._nan_mismatched
        outcome.inf_mismatched = self._inf_mismatched
        outcome.nan_where_finite = self._nan_where_finite
        outcome.inf_where_finite = self._inf_where_finite
        if self._max_abs[1] >= 0:
            outcome.max_abs_diff = self._max_abs[0]
            outcome.max_abs_index = self._unravel(self._max_abs[1])
            outcome.max_rel_diff = self._max_rel[0]
            outcome.max_rel_index = self._unravel(self._max_rel[1])
        outcome.budget_ratio = max(self._max_ratio, 0.0) if self.numel else None
        outcome.rel_l2 = self._relative(self._diff_squares)
        if self._yardstick_max >= 0:
            outcome.yardstick_max_abs_diff = self._yardstick_max
            outcome.yardstick_rel_l2 = self._relative(self._yardstick_squares)
        outcome.invalid_rows_zero = self._invalid_rows_zero
        outcome.mismatched_invalid_rows = self._mismatched_invalid_rows
        outcome.negative_zeros = self._negative_zeros
        count, total, total_squares, low, high = self._row_errors
        if count:
            mean = total / count
            spread = math.sqrt(max(total_squares / count - mean * mean, 0.0))
            outcome.row_rel_error = RowErrors(count, mean, spread, low, high)
        outcome.worst = self._worst_rows()
        if self._mismatched:
            problems.append(
                f"{self._mismatched:,} of {self.numel:,} elements differ beyond tolerance"
            )
        if self._invalid_rows_zero is False:
            problems.append("actual is not exactly 0 at every invalid position")
        outcome.passed = not problems
        return outcome

    def _relative(self, squares: float) -> float:
        if self._expected_squares > 0:
            return math.sqrt(squares / self._expected_squares)
        return 0.0 if squares == 0 else math.inf

    def _worst_rows(self) -> list[WorstRow]:
        """The worst rows, worst first, then the row of the greatest absolute difference when
        it is not among them (it may be within its allowance: the table then says so)."""
        worst = [
            self._worst_row(-negative_flat, actual, expected, allowed)
            for _, negative_flat, actual, expected, allowed in sorted(self._worst, reverse=True)
        ]
        value, flat, actual, expected, allowed = self._max_abs
        if worst and value > 0 and all(w.index != self._unravel(flat) for w in worst):
            worst.append(self._worst_row(flat, actual, expected, allowed))
        return worst

    def _worst_row(self, flat: int, actual: float, expected: float, allowed: float) -> WorstRow:
        index = self._unravel(flat)
        finite = math.isfinite(actual) and math.isfinite(expected)
        return WorstRow(
            row=index[:-1] if len(self.shape) >= 2 else index,
            index=index,
            actual=actual,
            expected=expected,
            abs_diff=abs(actual - expected) if finite else math.inf,
            allowed=allowed,
        )

    def _unravel(self, flat: int) -> list[int]:
        index = []
        for size in reversed(self.shape):
            flat, position = divmod(flat, size) if size else (flat, 0)
            index.append(position)
        return index[::-1]


def is_integral(dtype: torch.dtype | None) -> bool:
    """Whether ``dtype`` holds integers (bool included): compared exactly, not as float64.

    Example:
        >>> import torch
        >>> is_integral(torch.uint64), is_integral(torch.bool), is_integral(torch.float16)
        (True, True, False)
    """
    return dtype is not None and _dtype_name(dtype) in INTEGRAL_DTYPES


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
        self._mismatched += chunk_bad
        self.beyond += chunk_bad

        value, index = difference.argmax()
        if value > self._max_abs[0]:
            expected_value = e.value(index)
            self._max_abs = (
                value, self._offset + index, a.value(index), expected_value,
                self._allowed(expected_value),
            )  # fmt: skip
        relative = (diff / magnitude).nan_to_num_(nan=0.0, posinf=math.inf)
        index = int(relative.argmax())
        ratio = _exact_ratio(difference.value(index), scale.value(index))
        if ratio > self._max_rel[0]:
            self._max_rel = (ratio, self._offset + index)
        if bound is not None:
            allowed = bound > 0
            if bool(allowed.any()):
                ratio = float((diff[allowed] / bound[allowed]).max())
                self._max_ratio = max(self._max_ratio, ratio)
        elif self.atol > 0:
            self._max_ratio = max(self._max_ratio, float(diff.max()) / self.atol)
        self._diff_squares += float(diff.square().sum())
        self._expected_squares += float(magnitude.square().sum())

        if chunk_bad:
            length = self.row_length
            rows_bad = bad.view(-1, length).any(dim=1)
            self._mismatched_rows += int(rows_bad.sum())
            if len(self.failing_rows) < RECORDED_ROWS:
                more = rows_bad.nonzero().squeeze(1)[: RECORDED_ROWS - len(self.failing_rows)]
                self.failing_rows += (more + self._offset // length).tolist()
            self._track_worst_exact(bad, difference, a, e)
        self._offset += count

    def _update_equal(self, values: ExactIntegers) -> None:
        """What :meth:`update` does with a chunk whose actual and expected ``values`` are
        equal: every difference is 0, at index 0 first, and only ``|e|``'s squares add up."""
        if self._max_abs[0] < 0:
            first = values.value(0)
            self._max_abs = (0, self._offset, first, first, self._allowed(first))
        if self._max_rel[0] < 0:
            self._max_rel = (0.0, self._offset)
        if self.atol > 0 or (self.rtol > 0 and bool(values.nonzero_mask().any())):
            self._max_ratio = max(self._max_ratio, 0.0)  # 0 of a bound above 0
        # |e| rounds to float64 as e does, but for its sign: the squares are the same
        self._expected_squares += float(values.as_float64().square().sum())
        self._offset += values.high.numel()

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
            entry = (
                worst.value(row), -(self._offset + flat), a.value(flat), expected,
                self._allowed(expected),
            )  # fmt: skip
            if len(self._worst) < WORST_ROWS:
                heapq.heappush(self._worst, entry)  # type: ignore[arg-type]
            else:
                heapq.heappushpop(self._worst, entry)  # type: ignore[arg-type]


ONE_THREAD_BELOW = 1 << 15
"""Tensors of fewer elements are compared on one thread (see :func:`threads_for`)."""


@contextlib.contextmanager
def threads_for(numel: int) -> Iterator[None]:
    """torch on one thread for the block when a tensor of ``numel`` elements is small.

    Threads gain nothing on so little work (torch splits no elementwise kernel below 32,768
    elements), and some reductions start them anyway: with 2 threads on a busy machine a
    ``max(dim=1)`` of shape ``[2, 1]`` took 3.2 ms, against 3 µs on one thread, and diffing
    2,000 tensors of 2 elements that all differ took 25 s. Large tensors keep every thread.

    Example:
        >>> import torch
        >>> before = torch.get_num_threads()
        >>> with threads_for(8):
        ...     inside = torch.get_num_threads()
        >>> inside, torch.get_num_threads() == before
        (1, True)
    """
    if numel >= ONE_THREAD_BELOW:
        yield
        return
    from maskln_cli.threads import one_thread

    with one_thread():  # this thread only: not torch.set_num_threads, which sets all threads'
        yield


def compare_tensors(
    name: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    rtol: float | None = None,
    atol: float | None = None,
    keep_rows: torch.Tensor | None = None,
) -> TensorComparison:
    """Compare two whole tensors (which may be memory-mapped), a chunk of rows at a time.

    ``keep_rows`` (bool, one per row of a ``[..., C]`` tensor) leaves the other rows out
    (see :mod:`maskln_cli.validrows`).

    Example:
        >>> import torch
        >>> result = compare_tensors("t", torch.tensor([1.0, float("nan")]),
        ...                          torch.tensor([1.0, float("nan")]))
        >>> result.passed, result.nan_mismatched
        (True, 0)
    """
    integers = is_integral(actual.dtype) and is_integral(expected.dtype)
    comparison = (IntegerComparison if integers else Comparison)(
        name,
        list(actual.shape),
        _dtype_name(actual.dtype),
        list(expected.shape),
        _dtype_name(expected.dtype),
        rtol,
        atol,
    )
    if not (converts_to_float64(actual.dtype) and converts_to_float64(expected.dtype)):
        return comparison.result(_compare_bytes(actual, expected, comparison), compared=False)
    from maskln_cli.validrows import count_left_out, leave_out

    if comparison.comparable and comparison.numel:
        length = comparison.row_length
        step = comparison.chunk_rows() * length
        flat_actual, flat_expected = actual.reshape(-1), expected.reshape(-1)
        with threads_for(comparison.numel):
            for start in range(0, comparison.numel, step):
                chunk_actual = flat_actual[start : start + step]
                chunk_expected = flat_expected[start : start + step]
                if keep_rows is None:
                    comparison.update(chunk_actual, chunk_expected)
                    continue
                row = start // length
                keep = keep_rows[row : row + chunk_actual.numel() // length]
                if isinstance(comparison, IntegerComparison):
                    keep = keep.repeat_interleave(length)
                    comparison.update(chunk_actual, chunk_expected, keep=keep)
                else:  # in float64: not every dtype has masked_fill (float8 has not)
                    chunk_actual, chunk_expected = chunk_actual.double(), chunk_expected.double()
                    comparison.update(*leave_out(chunk_actual, chunk_expected, keep))
    outcome = comparison.result()
    if keep_rows is not None and comparison.comparable:
        count_left_out(outcome, int((~keep_rows).sum()))
    return outcome


def _compare_bytes(
    actual: torch.Tensor, expected: torch.Tensor, comparison: Comparison
) -> list[str]:
    """Tensors whose values have no float64 form (complex, float4) must be equal bit for bit."""
    import torch

    dtype = _dtype_name(actual.dtype)
    if not comparison.same_shape or actual.dtype != expected.dtype:
        return [f"values not compared: {dtype} vs {_dtype_name(expected.dtype)}"]
    as_bytes = (t.contiguous().reshape(-1).view(torch.uint8) for t in (actual, expected))
    if torch.equal(*as_bytes):
        return []
    return [f"{dtype} values differ (compared bit for bit: {dtype} has no float64 form)"]


def missing(
    name: str, side: str, shape: Sequence[int], dtype: str, hint: str = ""
) -> TensorComparison:
    """The outcome for a key present on one side only (``side`` is where it is missing)."""
    present_shape, present_dtype = list(shape), dtype
    actual_side = side == "actual"
    return TensorComparison(
        name=name,
        passed=False,
        problems=[f"missing in {side}{hint}"],
        shape=None if actual_side else present_shape,
        expected_shape=present_shape if actual_side else None,
        dtype=None if actual_side else present_dtype,
        expected_dtype=present_dtype if actual_side else None,
        rtol=math.nan,
        atol=math.nan,
    )


def diff_files(
    actual_path: str,
    expected_path: str,
    keys: Sequence[str] = (),
    rtol: float | None = None,
    atol: float | None = None,
    valid: str | None = None,
) -> ComparisonReport:
    """Compare two safetensors files key by key (``-`` for stdin, on one side at most).

    With ``keys``, only those keys are compared (each must exist on at least one side). With
    ``valid`` (``FILE[:KEY]``, a mask), tensors of shape ``[*mask.shape, C]`` are compared on
    the mask's valid rows only.

    Example:
        >>> report = diff_files("sample_data/worked_example.safetensors",
        ...                     "sample_data/worked_example.safetensors")
        >>> report.passed, [t.name for t in report.tensors]
        (True, ['bias', 'scale', 'x', 'valid'])
    """
    if [actual_path, expected_path].count("-") > 1:
        raise MasklnError("ACTUAL and EXPECTED cannot both be '-' (stdin)")
    if valid is not None and "-" in (actual_path, expected_path):
        from maskln_cli.validrows import parse_mask_spec

        if parse_mask_spec(valid)[0] == "-":
            raise MasklnError("--valid cannot read stdin when ACTUAL or EXPECTED does")
    check_tolerance(rtol, "--rtol")
    check_tolerance(atol, "--atol")
    with contextlib.ExitStack() as stack:
        actual = stack.enter_context(open_tensor_file(actual_path))
        expected = stack.enter_context(open_tensor_file(expected_path))
        names = _key_union(actual, expected)
        if keys:
            unknown = [k for k in keys if k not in names]
            if unknown:
                raise MasklnError(
                    f"--key: {unknown[0]!r} is in neither {actual.name} nor {expected.name}"
                )
            names = [k for k in names if k in set(keys)]
        notes: list[str] = []
        mask = None
        if valid is not None:
            from maskln_cli.validrows import open_row_mask, row_mask_notes

            mask = stack.enter_context(open_row_mask(valid))
            notes += row_mask_notes(mask, {n: _shape(actual, expected, n) for n in names})
        tensors = list(_compare_keys(actual, expected, names, rtol, atol, mask))
        return ComparisonReport("diff", actual.name, expected.name, tensors, notes)


def _shape(actual: TensorFile, expected: TensorFile, name: str) -> tuple[int, ...]:
    return (actual if name in actual else expected).info(name).shape


SMALL_ELEMENTS = 1024
"""Floating tensors of at most this many elements are compared many at a time
(:meth:`Comparison.update_many`)."""
SMALL_BATCH = 4096
"""How many such tensors at a time, at most."""


def _compare_keys(
    actual: TensorFile,
    expected: TensorFile,
    names: Sequence[str],
    rtol: float | None,
    atol: float | None,
    mask: RowMask | None = None,
) -> list[TensorComparison]:
    outcomes: dict[str, TensorComparison] = {}
    small: dict[tuple[str, tuple[int, ...]], list[str]] = {}  # by dtype and shape
    for name in names:
        if name not in actual:
            info = expected.info(name)
            outcomes[name] = missing(name, "actual", info.shape, info.dtype)
        elif name not in expected:
            info = actual.info(name)
            outcomes[name] = missing(name, "expected", info.shape, info.dtype)
        else:
            info, expected_info = actual.info(name), expected.info(name)
            if not (has_values(info.dtype) and has_values(expected_info.dtype)):
                outcomes[name] = _compare_stored_bytes(actual, expected, info, expected_info)
                continue
            keep = mask.keep if mask and mask.applies_to(info.shape) else None
            same = (info.dtype, info.shape) == (expected_info.dtype, expected_info.shape)
            floating = info.dtype not in INTEGRAL_DTYPES  # integers: IntegerComparison
            if same and floating and keep is None and 0 < info.numel <= SMALL_ELEMENTS:
                small.setdefault((info.dtype, info.shape), []).append(name)
                continue
            outcomes[name] = compare_tensors(
                name, actual.tensor(name), expected.tensor(name), rtol, atol, keep
            )
    for (dtype, shape), group in small.items():
        for start in range(0, len(group), SMALL_BATCH):
            batch = group[start : start + SMALL_BATCH]
            outcomes.update(_compare_small(actual, expected, batch, dtype, shape, rtol, atol))
    return [outcomes[name] for name in names]


def _compare_small(
    actual: TensorFile,
    expected: TensorFile,
    names: list[str],
    dtype: str,
    shape: tuple[int, ...],
    rtol: float | None,
    atol: float | None,
) -> dict[str, TensorComparison]:
    """Tensors of one dtype and shape on both sides, small: compared many at a time, those
    not all finite and within tolerance one by one."""

    actuals, expecteds = actual.stacked(names), expected.stacked(names)
    comparisons = [Comparison(name, shape, dtype, shape, dtype, rtol, atol) for name in names]
    with threads_for(actuals.numel()):
        fed = Comparison.update_many(comparisons, actuals, expecteds)
    return {
        name: comparison.result()
        if done
        else compare_tensors(name, a.reshape(shape), e.reshape(shape), rtol, atol)
        for name, comparison, done, a, e in zip(
            names, comparisons, fed, actuals, expecteds, strict=True
        )
    }


COMPARED_BYTES = 1 << 24
"""Bytes of a tensor without values read from each file at a time."""


def _compare_stored_bytes(
    actual: TensorFile, expected: TensorFile, info: TensorInfo, expected_info: TensorInfo
) -> TensorComparison:
    """A tensor whose values maskln cannot read (complex, F4, F6): its shape and dtype as the
    headers say, and its data compared bit for bit, as stored."""
    name, dtype = info.name, info.dtype
    comparison = Comparison(
        name, info.shape, dtype, expected_info.shape, expected_info.dtype, 0.0, 0.0
    )
    problems = []
    if dtype != expected_info.dtype:
        problems.append(f"values not compared: {dtype} vs {expected_info.dtype}")
    elif comparison.same_shape and not _same_bytes(actual, expected, name):
        problems.append(
            f"{dtype} values differ (compared bit for bit: {dtype} has no float64 form)"
        )
    return comparison.result(problems, compared=False)


def _same_bytes(actual: TensorFile, expected: TensorFile, name: str) -> bool:
    size = actual.data_size(name)
    if size != expected.data_size(name):
        return False
    for start in range(0, size, COMPARED_BYTES):
        stop = start + COMPARED_BYTES
        if actual.read_data(name, start, stop) != expected.read_data(name, start, stop):
            return False
    return True


def _key_union(actual: TensorFile, expected: TensorFile) -> list[str]:
    """Keys of both files: actual's in file order, then those only expected has."""
    names = actual.keys()
    seen = set(names)
    return names + [k for k in expected if k not in seen]


def times(ratio: float) -> str:
    """A ratio as reports print it: ``1.1x``, ``3,412x``.

    Example:
        >>> times(1.08), times(3412.5)
        ('1.1x', '3,412x')
    """
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.2g}x"


def check_tolerance(value: float | None, option: str) -> None:
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise MasklnError(f"{option}: must be a finite number >= 0, got {value}")
