"""Judging the elements of a block against their allowances, for the fast path
(:mod:`maskln_cli.compare.blocks`): how many are beyond, the greatest ratio, the factor needed
and each failing row's worst element.

When the allowances are costly to make (``maskln verify``'s budgets), an
:class:`AllowancesOnDemand` has them made only for the rows that can change a figure.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    Allowances = Callable[..., dict[str, torch.Tensor]]
    """``allowance_of(rows)``: the allowance pieces (``allowance``, and ``budget_unit`` and
    ``always`` when budgeted) of some rows of a block (None: all), as
    :meth:`Comparison.update` takes them; ``allowance_of(rows, later=True)``: a function of
    no argument making them later, holding copies of just those rows;
    ``allowance_of(None, always=floors)``: those of every row, taking ``floors`` (the bits its
    ``always`` would be) instead of making them again."""

    Judged = tuple[torch.Tensor | None, float, float, tuple[torch.Tensor, ...] | None]
    """What :meth:`BlockJudge.judge` finds: elements beyond per row (None: none), the greatest
    ratio, the factor needed, and the worst element of each row with one beyond."""


PICKED_FIRST = 8
"""Rows of a block judged first when no ratio found so far rules out most (see
:meth:`AllowancesOnDemand._rows_to_judge`)."""
FIRST_RETRY = 8
"""Blocks whose likeliest rows are not judged first after that spared a block nothing."""
PICKED_SHARE = 4
"""When more than one row in this many needs its allowances, every row of the block gets
them: gathering the rows would cost more than it saves."""


class BlockJudge:
    """Judges the elements of blocks of rows of ``row_length`` against their allowances;
    failing rows are ranked by ratio or by absolute difference (``rank_by_ratio``)."""

    def __init__(self, row_length: int, rank_by_ratio: bool) -> None:
        self.row_length = row_length
        self.rank_by_ratio = rank_by_ratio
        # Blocks since judging a block's likeliest rows first last spared it most of its
        # rows' allowances (see AllowancesOnDemand._rows_to_judge): a tensor whose allowances
        # are far above its floors (grad_x's) has every row judged all the same. Only which
        # rows are judged when depends on it (blocks on several threads share it), never a
        # figure.
        self.first_in_vain = 0
        # Blocks since a finer ceiling (from the floors) last spared a block most of its rows'
        # allowances, a ratio being known (see AllowancesOnDemand._rows_to_judge): likewise
        # tried again only every FIRST_RETRY blocks once it did not.
        self.finer_in_vain = 0
        # Likewise the likeliest rows first where only some rows are to be judged.
        self.some_first_in_vain = 0
        # Blocks since the floors alone last failed to spare a block most rows where a finer
        # bound was at hand (grad_x's at C = 1024; at C = 128 they suffice, and cost less).
        self.floors_in_vain = 0

    def judge(
        self,
        diff: torch.Tensor,
        bound: torch.Tensor,
        positive: bool | None,
        actual: torch.Tensor,
        e64: torch.Tensor,
        rows: int,
        budget_unit: torch.Tensor | None,
        always: torch.Tensor | None,
        row_max: torch.Tensor | None = None,
    ) -> Judged | None:
        """The figures of a block that depend on each element's allowance ``bound``: elements
        beyond it per row (None: none), the greatest ratio, the factor needed, and the worst
        element of each row with one beyond (indices into the block). None on a NaN factor.
        ``positive``: whether every bound is above 0 (None: not known, found row by row);
        ``row_max``: each row's greatest difference, when the caller has it."""
        import torch

        length = self.row_length
        zero_rows = None
        if positive is None:
            # Each row's least bound: one pass, as a test of the whole block's would be, which
            # tells the rows allowed more than 0 everywhere, where no ratio is 0/0.
            row_least = bound.view(rows, length).amin(dim=1)
            zero_rows = (~(row_least > 0)).nonzero().squeeze(1)
            positive = not zero_rows.numel()
        ratio = torch.div(diff, bound)
        if positive:  # no 0/0: the ratio has no NaN to mask
            max_ratio = float(ratio.max())
            # diff > bound > 0 makes the ratio 1 or more, even rounded.
            bad = diff > bound if max_ratio >= 1 else None
        elif zero_rows is not None:
            max_ratio, bad = self._ratio_by_rows(diff, bound, ratio, rows, zero_rows, row_max)
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
            if any_true(beyond):
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
            worst = (bad_rows, score, flat, actual[flat].double(), e64[flat], bound[flat])
        return counts, max_ratio, factor, worst

    def _ratio_by_rows(
        self,
        diff: torch.Tensor,
        bound: torch.Tensor,
        ratio: torch.Tensor,
        rows: int,
        zero_rows: torch.Tensor,
        row_max: torch.Tensor | None,
    ) -> tuple[float, torch.Tensor | None]:
        """The greatest ratio over the elements allowed more than 0 (as ``torch.where(bound >
        0, ratio, 0).max()`` with NaN as 0, the same value), and the elements beyond their
        bound (None: none), when only rows ``zero_rows`` have a bound of 0 or less: each other
        row's ratios have no NaN, and their greatest is taken row by row. A row of
        ``zero_rows`` without a difference has ratios of 0 or NaN only (0 either way); the
        others (padding that is not 0) are taken element by element. An element beyond its
        bound is either in those, or has a ratio of 1 or more (diff > bound > 0, even
        rounded)."""
        import torch

        length = self.row_length
        by_row = ratio.view(rows, length).amax(dim=1)
        if row_max is None:
            row_max = diff.view(rows, length).amax(dim=1)
        differing = zero_rows[row_max.index_select(0, zero_rows) > 0]
        by_row.index_fill_(0, zero_rows, 0.0)
        if differing.numel():
            some = ratio.view(rows, length).index_select(0, differing)
            allowed = bound.view(rows, length).index_select(0, differing) > 0
            some = torch.where(allowed, some.nan_to_num_(nan=0.0, posinf=math.inf), 0.0)
            by_row.index_copy_(0, differing, some.amax(dim=1))
        max_ratio = float(by_row.max())
        bad = diff > bound if max_ratio >= 1 or differing.numel() else None
        return max_ratio, bad


def any_true(flags: torch.Tensor) -> bool:
    """``bool(flags.any())`` of a contiguous bool tensor, read as bytes (0 or 1) whose greatest is
    taken: a vectorized reduction, where ``any`` of a block's flags took 20 times as long.

    Example:
        >>> import torch
        >>> any_true(torch.tensor([False, True])), any_true(torch.zeros(3, dtype=torch.bool))
        (True, False)
    """
    import torch

    if not flags.numel():
        return False
    return bool(flags.reshape(-1).view(torch.uint8).amax())


@dataclass(eq=False)  # tensors inside: compared by identity, as before
class AllowancesOnDemand:
    """A block whose allowances ``allowance_of`` makes, judged on the rows that need them.

    ``diff`` and ``e64`` are the block's differences and expected values in float64,
    ``actual`` its actual values in their own dtype (converted where read),
    ``row_max`` each row's greatest difference, ``invalid`` its invalid rows (or None); every
    element of a valid row is allowed ``lower`` or more, and invalid rows nothing.
    ``floors`` (or None) makes each element's floor, what it is always allowed, at most its
    allowance and at least ``lower`` on a valid row: finer row ceilings than ``lower``'s,
    where those would have every row's allowances made.
    """

    judge: BlockJudge
    diff: torch.Tensor
    row_max: torch.Tensor
    actual: torch.Tensor
    e64: torch.Tensor
    invalid: torch.Tensor | None
    allowance_of: Allowances
    lower: float
    rows: int
    floors: Callable[..., torch.Tensor | None] | None = None
    # |e64|, every value finite, for ``floors(finite_abs=...)`` (None: floors() makes it).
    e_abs: torch.Tensor | None = None
    # The floors made by _rows_to_judge (None: not made), taken as ``always`` when every row
    # is judged after all: the same bits, not made twice.
    made_floors: torch.Tensor | None = None
    # ``bounds(finite_abs=...)`` (or None) makes a lower bound of each element's allowance on
    # valid rows, far finer than its floor where the allowance is far above it (grad_x's);
    # None from it: no bound.
    bounds: Callable[..., torch.Tensor | None] | None = None

    def judged(self, top: int, known: float) -> tuple | None:
        """:meth:`BlockJudge.judge` on the rows :meth:`_rows_to_judge` picks (``known``: the
        greatest ratio merged so far), their allowances made by ``allowance_of``; the figures
        of the rows left out are known without them. Then the allowance of element ``top``
        (the greatest difference), or NaN and how to make it."""
        import torch

        diff, actual, e64, rows = self.diff, self.actual, self.e64, self.rows
        length = self.judge.row_length
        top_row, channel = divmod(top, length)
        picked = self._rows_to_judge(top_row, known)
        if picked is None:  # every row: nothing to gather
            made = self.allowance_of(None, always=self.made_floors)
            pieces = {k: v.reshape(-1).double() for k, v in made.items()}
            bound = pieces["allowance"]
            judged = self.judge.judge(
                diff, bound, None, actual, e64, rows, pieces.get("budget_unit"),
                pieces.get("always"), self.row_max,
            )  # fmt: skip
            return None if judged is None else (*judged, float(bound[top]), None)
        if not picked.numel():
            # No element beyond anything, no ratio above one already merged (so -1 here):
            # only the greatest difference's allowance may be reported, made if it is.
            pair = sorted({top_row, 1 if top_row == 0 else 0})
            at = pair.index(top_row) * length + channel
            later = self.allowance_of(torch.tensor(pair), later=True)

            def allowed() -> float:
                return float(later()["allowance"].reshape(-1)[at])

            return None, -1.0, 0.0, None, math.nan, allowed
        part = self._judge_picked(picked)
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

    def _judge_picked(self, picked: torch.Tensor) -> tuple[Judged, torch.Tensor] | None:
        """:meth:`BlockJudge.judge` of rows ``picked`` (sorted indices), and their
        allowances."""
        length = self.judge.row_length
        count = picked.numel()

        def gather(t: torch.Tensor) -> torch.Tensor:
            return t.view(-1, length).index_select(0, picked).reshape(-1)

        pieces = {k: v.reshape(-1).double() for k, v in self.allowance_of(picked).items()}
        bound = pieces["allowance"]
        judged = self.judge.judge(
            gather(self.diff), bound, bool(bound.amin() > 0), gather(self.actual),
            gather(self.e64), count, pieces.get("budget_unit"), pieces.get("always"),
        )  # fmt: skip
        return None if judged is None else (judged, bound)

    def _rows_to_judge(self, top_row: int, known: float) -> torch.Tensor | None:
        """The rows (sorted indices, two or more: torch sums a lone row differently) whose
        allowances :meth:`judged` needs; None for all of them, none (empty) when only the
        greatest difference's allowance (in row ``top_row``) may be needed.

        A valid row's elements are each allowed ``lower`` or more, so a row whose greatest
        difference ``d`` is at most ``lower`` has no element beyond (nor beyond what is always
        allowed), and no ratio above ``d / lower`` (rounding is monotonic). So only rows where
        ``d / lower`` reaches 1 (as it does when ``d > lower``), or exceeds a ratio already
        found (in this block, or merged from earlier chunks: ``known``), can change a figure;
        and invalid rows (allowed nothing) that are not all 0.
        """
        import torch

        lower, invalid, rows = self.lower, self.invalid, self.rows
        if lower <= 0 or rows <= 2:
            return None
        # inf for an invalid row that is not all 0, NaN (never picked) for one that is.
        lows = torch.where(invalid, 0.0, lower) if invalid is not None else lower
        ceiling = torch.div(self.row_max, lows)  # >= every ratio of a valid row

        def pick(known: float) -> torch.Tensor:
            return ceiling > known if known < 1 else ceiling >= 1

        picked = pick(known)
        count = int(picked.sum())
        floors = None
        if count * PICKED_SHARE > rows and self.floors:
            # |expected|, all finite on the fast path (which stops at NaN or inf), not made again
            floors = self.floors(finite_abs=self.e_abs) if self.e_abs is not None else self.floors()
        self.made_floors = floors
        judge = self.judge
        # Not tried again for FIRST_RETRY blocks once it spared a block nothing (a tensor
        # whose allowances are far above its floors, grad_x's): the floors are kept all the
        # same, to be each element's ``always`` (the same figures either way).
        if floors is not None and judge.finer_in_vain % FIRST_RETRY == 0:
            # Each element's ratio is at most its difference over its floor (the allowance is
            # the floor or more, and rounding is monotonic): a few passes over the block that
            # spare most rows their allowances (a correct kernel's differences are mostly far
            # below the floor). Invalid rows keep theirs (allowed nothing).
            coarse = ceiling
            alone = self.bounds is None or (known > 0 and judge.floors_in_vain % FIRST_RETRY == 0)
            finer = self._finer_ceiling(floors.reshape(-1), alone)  # may take the floors' buffer
            ceiling = torch.where(invalid, coarse, finer) if invalid is not None else finer
            picked = pick(known)
            count = int(picked.sum())
            if self.bounds is not None and alone:  # then the bound, if the floors were not enough
                judge.floors_in_vain = 1 if count * PICKED_SHARE > rows else 0
                if judge.floors_in_vain:
                    finer = self._finer_ceiling(floors.reshape(-1), False)
                    ceiling = torch.where(invalid, coarse, finer) if invalid is not None else finer
                    picked = pick(known)
                    count = int(picked.sum())
            elif self.bounds is not None and known > 0:
                judge.floors_in_vain += 1
            if known > 0:  # in vain only once a ratio is known (before, every row may hold it)
                judge.finer_in_vain = 1 if count * PICKED_SHARE > rows else 0
        elif floors is not None:
            judge.finer_in_vain += 1
        # Every row is judged unless the likeliest rows' ratio rules most out: not tried
        # again for FIRST_RETRY blocks once it did not (the same figures either way).
        # Where only some rows are to be judged, likewise once the likeliest rows spared fewer
        # rows than they are (the ratio merged from earlier chunks already as great: out's).
        every = count * PICKED_SHARE > rows
        in_vain = judge.first_in_vain if every else judge.some_first_in_vain
        if count > PICKED_FIRST and in_vain % FIRST_RETRY == 0:
            # Without a ratio as great as this block's yet, judge its likeliest rows first
            # (and again with the rest: the greatest ratio is then among those judged).
            before = count
            first = ceiling.nan_to_num(nan=-1.0).topk(PICKED_FIRST).indices.sort().values
            part = self._judge_picked(first)
            if part is not None and part[0][1] > known:
                picked = pick(part[0][1])
                picked[first] = True
                count = int(picked.sum())
            if every:
                judge.first_in_vain = 1 if count * PICKED_SHARE > rows else 0
            else:
                judge.some_first_in_vain = 1 if before - count < PICKED_FIRST else 0
        elif every:
            judge.first_in_vain += 1
        elif count > PICKED_FIRST:
            judge.some_first_in_vain += 1
        if count * PICKED_SHARE > rows:
            return None
        if count:
            picked[top_row] = True
            if count == 1:
                picked[1 if top_row == 0 else 0] = True
        return picked.nonzero().squeeze(1)

    def _finer_ceiling(self, floors: torch.Tensor, alone: bool = False) -> torch.Tensor:
        """Each row's greatest ratio at most, on valid rows: its greatest difference over the
        floor (the allowance is the floor or more, and rounding is monotonic), or, given
        :attr:`bounds`, over the greater of the floor and the bound. A row with an element
        beyond its floor (then its factor needed counts) gets inf: it is judged. Without a
        bound the ratios are made in the floors' buffer (an in-place pass, where a new one
        costs three times as much): :attr:`made_floors` is then None, and the floors are made
        again with the allowances if every row is judged after all (rarely). ``alone``: the
        floors alone, in a buffer of its own where a bound is at hand (it may be needed
        next)."""
        import torch

        rows, length = self.rows, self.judge.row_length
        if alone and self.bounds is not None:
            return torch.div(self.diff, floors).view(rows, length).amax(dim=1)
        lower = None
        if self.bounds is not None and self.e_abs is not None:
            lower = self.bounds(finite_abs=self.e_abs)
        if lower is None:
            self.made_floors = None
            ratios = torch.div(self.diff, floors, out=floors)
            return ratios.view(rows, length).amax(dim=1)
        beyond = torch.gt(self.diff, floors).view(rows, length).view(torch.uint8).amax(dim=1)
        ceiling = torch.maximum(lower, floors, out=lower)
        ceiling = torch.div(self.diff, ceiling, out=ceiling).view(rows, length).amax(dim=1)
        return ceiling.masked_fill_(beyond.bool(), math.inf)
