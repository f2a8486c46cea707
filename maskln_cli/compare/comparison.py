"""Comparing tensors, chunk by chunk, into plain data (``maskln diff`` and ``maskln verify``).

An element passes when ``|actual - expected| <= atol + rtol * |expected|`` (computed in float64);
NaN matches NaN only at the same position, and inf matches only the same inf. A
:class:`Comparison` is fed consecutive chunks of whole rows and keeps only running figures
(:mod:`maskln_cli.compare.figures`), so multi-GB tensors compare in bounded memory: a chunk of
finite floating values in blocks measured on worker threads, then merged (:meth:`measure`,
:meth:`merge`), any other in float64 as a whole (:mod:`maskln_cli.compare.general`). Integers
and bool are compared exactly instead (:mod:`maskln_cli.compare.integers`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from maskln_cli.compare import general
from maskln_cli.compare.data import (
    WORST_ROWS,
    BlockFigures,
    PerElement,
    TensorComparison,
    converts_to_float64,
    default_tolerance,
)
from maskln_cli.compare.figures import RunningFigures, padding_of
from maskln_cli.files.tensorfile import torch_dtype
from maskln_cli.op.threads import map_blocks

if TYPE_CHECKING:
    import torch

    Allowances = Callable[..., dict[str, torch.Tensor]]
    """``allowance_of(rows)``: the allowance pieces (``allowance``, and ``budget_unit`` and
    ``always`` when budgeted) of some rows of a block (None: all), as
    :meth:`Comparison.update` takes them; ``allowance_of(rows, later=True)``: a function of
    no argument making them later, holding copies of just those rows."""


CHUNK_ELEMENTS = 1 << 22
"""Elements compared at a time (rounded to whole rows): a few float64 temporaries of 32 MiB."""
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


class Comparison(RunningFigures):
    """Running comparison of one tensor, fed consecutive chunks of whole rows: its running
    figures (:class:`RunningFigures`), and how chunks feed them.

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
        super().__init__(shape, rank_by_ratio)
        default_rtol, default_atol = default_tolerance(dtype, expected_dtype)
        self.name = name
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
        # A dtype difference is a problem (diff), or by design (verify: float64 reference).
        self.same_dtype = same_dtype

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
        per_element = PerElement(allowance, yardstick, budget_unit, always)
        blocks = self._block_ranges(a.numel())
        if blocks:
            flat = [None if t is None else t.detach().reshape(-1) for t in per_element]
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
        self._update_general(actual, expected, invalid_rows, per_element)

    def _update_general(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        invalid_rows: torch.Tensor | None,
        per_element: PerElement,
    ) -> None:
        """:meth:`update` for any values, NaN and inf included, on the whole chunk in float64
        (the definition the fast path of :meth:`measure` and :meth:`merge` reproduces)."""
        general.update_general(
            self, actual, expected, invalid_rows, per_element, self.rtol, self.atol,
            self.dtype,
        )  # fmt: skip

    def _block_ranges(self, numel: int) -> list[tuple[int, int]]:
        """Blocks of whole rows (two or more, see :func:`maskln_cli.op.blocked.row_blocks`) of about
        :data:`BLOCK_ELEMENTS`; none when the chunk is empty or a dtype has no fast path."""
        if not numel or not self._fast:
            return []
        from maskln_cli.op.blocked import row_blocks

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
                block.padding = padding_of(a64.view(rows, length)[invalid])
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
        known = self.max_ratio

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
        if top_abs[0] > self.max_abs[0]:
            if top_block is not None and top_block.allowed_later is not None:
                top_abs = (*top_abs[:4], top_block.allowed_later())
            self.max_abs = (top_abs[0], self.offset + top_abs[1], *top_abs[2:])  # type: ignore[assignment]
        if top_rel[0] > self.max_rel[0]:
            self.max_rel = (top_rel[0], self.offset + top_rel[1])
        self.max_ratio = max(self.max_ratio, max(b.max_ratio for b in blocks))
        self.max_factor = max(self.max_factor, max(b.factor_needed for b in blocks))
        row_squares = torch.cat([b.row_squares for b in blocks])
        self.diff_squares += float(row_squares.sum())
        row_norms = torch.cat([b.row_norms for b in blocks])
        self.expected_squares += float(row_norms.sum())
        counts = None
        if any(b.counts is not None for b in blocks):
            counts = torch.cat([
                b.counts if b.counts is not None else torch.zeros(b.rows, dtype=torch.long)
                for b in blocks
            ])  # fmt: skip
        chunk_bad = int(counts.sum()) if counts is not None else 0
        self.mismatched += chunk_bad
        self.beyond += chunk_bad
        rows_bad = counts > 0 if counts is not None else None
        if rows_bad is not None:
            self.count_failing_rows(rows_bad)
            self._merge_worst(blocks, starts)
        yardstick_rows = None
        if blocks[0].yardstick_rows is not None:
            self.yardstick_max = max(self.yardstick_max, max(b.yardstick_max for b in blocks))
            yardstick_rows = torch.cat([b.yardstick_rows for b in blocks])  # type: ignore[misc]
            self.yardstick_squares += float(yardstick_rows.sum())
        if invalid_rows is not None:
            invalid = invalid_rows.reshape(-1)
            self.count_mismatched_invalid_rows(rows_bad, invalid)
            if counts is not None:
                self.beyond_in_invalid_rows += int(counts[invalid].sum())
            padding = [b.padding for b in blocks if b.padding is not None]
            self.add_padding(
                (all(z for z, _ in padding), sum(n for _, n in padding)) if padding else None
            )
            usable = ~invalid & (row_norms > 0)
            self.add_row_errors(usable, row_squares, row_norms, yardstick_rows)
        self.offset += total

    def _merge_worst(self, blocks: Sequence[BlockFigures], starts: Sequence[int]) -> None:
        """The chunk's worst rows from its blocks' candidates, as the general path keeps them."""
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
            self.keep_worst((
                float(score[k]), -(self.offset + int(flat[k])), float(actual[k]),
                float(expected[k]), float(allowed[k]),
            ))  # fmt: skip

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
        first = comparisons[0]
        return general.update_many(comparisons, actual, expected, first.rtol, first.atol)

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
        if self.offset != self.numel:
            raise ValueError(f"compared {self.offset} of {self.numel} elements of {self.name!r}")
        self.fill(outcome)
        outcome.passed = not outcome.problems
        return outcome
