"""The fast path of a comparison: a chunk's blocks of whole rows measured (on worker threads),
then merged into the running figures, for floating values that are all finite.

The float64 values and operations are those of the general path
(:mod:`maskln_cli.compare.general`), element by element and row by row, so every figure is the
same bit for bit; only work whose outcome is known is skipped (no NaN or inf to mask, no
element beyond when no ratio reaches 1). Sums over rows are taken over the whole chunk's rows,
in one call, as the general path takes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from maskln_cli.compare.data import WORST_ROWS, BlockFigures, PerElement
from maskln_cli.compare.figures import RunningFigures, padding_of
from maskln_cli.compare.judging import AllowancesOnDemand, BlockJudge

if TYPE_CHECKING:
    import torch

    from maskln_cli.compare.judging import Allowances


class BlockMeasurer:
    """Measures blocks of rows of ``row_length`` into :class:`BlockFigures`, within
    ``atol + rtol * |expected|`` when no allowance is given. It reads no running figure."""

    def __init__(self, row_length: int, rtol: float, atol: float, rank_by_ratio: bool) -> None:
        self.row_length = row_length
        self.rtol = rtol
        self.atol = atol
        self.judge = BlockJudge(row_length, rank_by_ratio)

    def measure(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        invalid_rows: torch.Tensor | None,
        per_element: PerElement,
        yardstick_error: torch.Tensor | None,
        allowance_of: Allowances | None,
        lower: float,
        known: float,
        floors: Callable[[], torch.Tensor | None] | None = None,
        keep_error: bool | torch.Tensor = False,
        bounds: Callable[..., torch.Tensor | None] | None = None,
        alike: bool = False,
    ) -> BlockFigures | None:
        """:meth:`Comparison.measure`, ``known`` being the greatest ratio merged so far."""
        import torch

        allowance, yardstick, budget_unit, always = per_element
        length = self.row_length
        rows = actual.numel() // length
        a = actual.detach().reshape(-1)
        e64 = expected.detach().reshape(-1).double()  # may be expected itself: never written
        # Promoted to float64 in the subtraction itself (the same bits): a float64 copy of
        # the actual values would be read only at a few elements, converted there. torch
        # promotes no float8 type: those are converted first.
        if a.dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
            a = a.double()
        into = keep_error.view(-1) if not isinstance(keep_error, bool) else None
        keep_error = keep_error is not False
        if alike:
            # The actual values are the yardstick's bit for bit: its error is the differences
            # (the caller's to give: squared in place below), and the signed ones, when kept,
            # are in keep_error already.
            assert yardstick_error is not None and (into is not None or not keep_error)
            error, diff = into, yardstick_error.reshape(-1)
        else:
            error = float64_minus(a, e64, into)
            # The signed error kept when asked (keep_error), else its buffer is the differences.
            diff = torch.abs(error) if keep_error else error.abs_()
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
            on_demand = AllowancesOnDemand(
                self.judge,
                diff,
                row_max,
                a,
                e64,
                invalid,
                allowance_of,
                lower,
                rows,
                floors,
                e_abs=e_abs,
                bounds=bounds,
            )
            judged = on_demand.judged(i, known)
        else:
            if allowance is None:
                bound = torch.mul(e_abs, self.rtol).add_(self.atol)
                positive = self.atol > 0  # then bound >= atol everywhere
            else:
                bound = allowance.detach().reshape(-1).double()
                positive = bool(bound.amin() > 0)  # False on NaN
            judged = self.judge.judge(diff, bound, positive, a, e64, rows, budget_unit, always)
            if judged is not None:
                judged = (*judged, float(bound[i]), None)
        if judged is None:
            return None
        counts, max_ratio, factor, worst, allowed, allowed_later = judged
        max_abs = (float(value), i, float(a[i]), float(e64[i]), allowed)
        # The greatest and its first index row by row, as the greatest difference's above:
        # what relative.max(dim=0) finds, at a third of its time; its 0/0 taken as 0.
        rel_rows = torch.div(diff, e_abs, out=e_abs).view(rows, length)
        value, rel_row = relative_row_max(rel_rows, row_max).max(dim=0)
        rel_row = int(rel_row)
        in_row = rel_rows[rel_row].nan_to_num(nan=0.0, posinf=math.inf).max(dim=0).indices
        max_rel = (float(value), rel_row * length + int(in_row))
        # The squares in place: the differences are no longer needed, nor the buffer.
        row_squares = diff.square_().view(rows, length).sum(dim=1)
        # Finite differences may still square to inf: the general path then counts them.
        if not math.isfinite(float(row_squares.sum())):
            return None
        row_norms = torch.square(e64, out=e_abs).view(rows, length).sum(dim=1)
        block = BlockFigures(
            rows, counts, max_abs, max_rel, max_ratio, factor, row_squares, row_norms, worst,
            allowed_later=allowed_later, error=error if keep_error else None,
        )  # fmt: skip
        if yardstick is not None and alike:  # its differences are diff: the same figures
            block.yardstick_max, block.yardstick_rows = max_abs[0], row_squares
        elif yardstick is not None:
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
                # In their own dtype (float64, float32 or a half one here): the same zeros
                # and signs as converted, without a float64 copy of the rows.
                # Gathered by index (the same rows as by the mask, at a third of the cost).
                padded = a.view(rows, length).index_select(0, invalid.nonzero().squeeze(1))
                block.padding = padding_of(padded)
        return block


def relative_row_max(relative: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """Each row's greatest relative difference ``[R]`` (``relative``: ``diff / |expected|``,
    ``[R, C]``; ``row_max``: each row's greatest ``diff``), 0/0 (NaN) taken as 0: what
    ``relative.nan_to_num(nan=0.0, posinf=inf).amax(dim=1)`` gives (a max is exact, read in
    any order), without a pass over the block to replace NaN. A row's greatest is NaN only
    where it holds a 0/0; where it has no difference either (padding a kernel left 0) every
    ratio is 0 or 0/0: its greatest is 0. Only rows with both (rare) are read again.

    Example:
        >>> import torch
        >>> diff = torch.tensor([[0.0, 1.0], [0.0, 0.0], [2.0, 0.0]], dtype=torch.float64)
        >>> expected = torch.tensor([[0.0, 4.0], [0.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
        >>> relative_row_max(diff / expected, diff.amax(dim=1)).tolist()
        [0.25, 0.0, inf]
    """
    greatest = relative.amax(dim=1)
    nan_rows = greatest.isnan().nonzero().squeeze(1)
    if nan_rows.numel():
        differing = nan_rows[row_max.index_select(0, nan_rows) > 0]
        greatest.index_fill_(0, nan_rows, 0.0)
        if differing.numel():
            some = relative.index_select(0, differing).nan_to_num_(nan=0.0, posinf=math.inf)
            greatest.index_copy_(0, differing, some.amax(dim=1))
    return greatest


def float64_minus(
    values: torch.Tensor, truth: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``values - truth`` in float64 (``truth``'s dtype), a new tensor (or ``out``, float64 of
    the same shape): float32 or half values converted in one pass and subtracted in place, the
    same bits as the promotion in a mixed subtraction, which converts element by element
    (slower)."""
    import torch

    if out is not None:
        return out.copy_(values).sub_(truth)
    if values.dtype == torch.float64:
        return torch.sub(values, truth)
    return values.to(torch.float64).sub_(truth)


def merge_blocks(
    figures: RunningFigures, blocks: Sequence[BlockFigures], invalid_rows: torch.Tensor | None
) -> None:
    """Add the figures of consecutive blocks making up one chunk (``invalid_rows``: one flag
    per row of the chunk), as the general path would add the whole chunk's."""
    import torch

    length = figures.row_length
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
    if top_abs[0] > figures.max_abs[0]:
        if top_block is not None and top_block.allowed_later is not None:
            top_abs = (*top_abs[:4], top_block.allowed_later())
        figures.max_abs = (top_abs[0], figures.offset + top_abs[1], *top_abs[2:])  # type: ignore[assignment]
    if top_rel[0] > figures.max_rel[0]:
        figures.max_rel = (top_rel[0], figures.offset + top_rel[1])
    figures.max_ratio = max(figures.max_ratio, max(b.max_ratio for b in blocks))
    figures.max_factor = max(figures.max_factor, max(b.factor_needed for b in blocks))
    row_squares = torch.cat([b.row_squares for b in blocks])
    figures.diff_squares += float(row_squares.sum())
    row_norms = torch.cat([b.row_norms for b in blocks])
    figures.expected_squares += float(row_norms.sum())
    counts = None
    if any(b.counts is not None for b in blocks):
        counts = torch.cat([
            b.counts if b.counts is not None else torch.zeros(b.rows, dtype=torch.long)
            for b in blocks
        ])  # fmt: skip
    chunk_bad = int(counts.sum()) if counts is not None else 0
    figures.mismatched += chunk_bad
    figures.beyond += chunk_bad
    rows_bad = counts > 0 if counts is not None else None
    if rows_bad is not None:
        figures.count_failing_rows(rows_bad)
        _merge_worst(figures, blocks, starts)
    yardstick_rows = None
    if blocks[0].yardstick_rows is not None:
        figures.yardstick_max = max(figures.yardstick_max, max(b.yardstick_max for b in blocks))
        yardstick_rows = torch.cat([b.yardstick_rows for b in blocks])  # type: ignore[misc]
        figures.yardstick_squares += float(yardstick_rows.sum())
    if invalid_rows is not None:
        invalid = invalid_rows.reshape(-1)
        figures.count_mismatched_invalid_rows(rows_bad, invalid)
        if counts is not None:
            figures.beyond_in_invalid_rows += int(counts[invalid].sum())
        padding = [b.padding for b in blocks if b.padding is not None]
        figures.add_padding(
            (all(z for z, _ in padding), sum(n for _, n in padding)) if padding else None
        )
        usable = ~invalid & (row_norms > 0)
        figures.add_row_errors(usable, row_squares, row_norms, yardstick_rows)
    figures.offset += total


def _merge_worst(
    figures: RunningFigures, blocks: Sequence[BlockFigures], starts: Sequence[int]
) -> None:
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
        figures.keep_worst((
            float(score[k]), -(figures.offset + int(flat[k])), float(actual[k]),
            float(expected[k]), float(allowed[k]),
        ))  # fmt: skip
