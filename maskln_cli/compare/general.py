"""The general path of a comparison: a whole chunk in float64, any values, NaN and inf included
(the definition the fast path of :mod:`maskln_cli.compare.blocks` reproduces); and many small
tensors at once, by the same operations, when every element is finite and within tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from maskln_cli.compare.data import WORST_ROWS, PerElement
from maskln_cli.compare.figures import RunningFigures, padding_of
from maskln_cli.files.tensorfile import torch_dtype

if TYPE_CHECKING:
    import torch


def update_general(
    figures: RunningFigures,
    actual: torch.Tensor,
    expected: torch.Tensor,
    invalid_rows: torch.Tensor | None,
    per_element: PerElement,
    rtol: float,
    atol: float,
    dtype: str,
) -> None:
    """Add a chunk of rows to ``figures``, as :meth:`Comparison.update` takes it, within
    ``atol + rtol * |expected|`` when no allowance is given; ``dtype`` is the actual tensor's
    (an actual inf where expected rounds to that inf in it passes an allowance)."""
    import torch

    allowance, yardstick, budget_unit, always = per_element
    a = actual.detach().reshape(-1).double()
    e = expected.detach().reshape(-1).double()
    if a.numel() != e.numel() or a.numel() % figures.row_length:
        raise ValueError("chunks must hold the same whole rows of both tensors")
    length = figures.row_length
    a_finite, e_finite = a.isfinite(), e.isfinite()
    finite = a_finite & e_finite
    clean = bool(finite.all())  # the usual case: no NaN or inf to account for
    diff = (a - e).abs_()
    if allowance is None:
        bound = e.abs().mul_(rtol).add_(atol)
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
            stored = torch_dtype(dtype) or torch.float64
            rounded = e.to(stored).double()
            # Or a value within its allowance rounds to that inf: the allowance reaches past
            # the dtype's largest finite value plus half its spacing there, on inf's side.
            largest = torch.finfo(stored).max
            beyond = largest + 2.0 ** math.floor(math.log2(largest)) * torch.finfo(stored).eps / 2
            reaches = (e.abs() + bound >= beyond) & (a.sign() == e.sign())
            same |= overflowed & ((rounded == a) | reaches)
        bad = ~(same | (finite & (diff <= bound)))
        figures.nan_mismatched += int((a_nan != e_nan).sum())
        figures.inf_mismatched += int(((a.isinf() | e.isinf()) & ~same & ~(a_nan | e_nan)).sum())
        figures.nan_where_finite += int((a_nan & e_finite).sum())
        figures.inf_where_finite += int((overflowed & ~same).sum())
    chunk_bad = int(bad.sum())
    figures.mismatched += chunk_bad
    figures.beyond += chunk_bad if clean else int((bad & finite).sum())

    _track_max_abs(figures, diff, a, e, bound)
    # |a - e| / |e|: inf at an expected 0 with a difference, 0 where both are 0
    relative = (diff / e.abs()).nan_to_num_(nan=0.0, posinf=math.inf)
    if relative.numel():
        value, index = relative.max(dim=0)
        if float(value) > figures.max_rel[0]:
            figures.max_rel = (float(value), figures.offset + int(index))
    # How far beyond its allowance each element is (inf where nothing was allowed); the
    # maximum is over elements allowed something: the padding is counted apart.
    ratio = (diff / bound).nan_to_num_(nan=0.0, posinf=math.inf)
    if ratio.numel():
        some = torch.where(bound > 0, ratio, 0.0)
        figures.max_ratio = max(figures.max_ratio, float(some.max()))
    if budget_unit is not None and always is not None:
        beyond = (diff > always.reshape(-1)) & finite
        if bool(beyond.any()):
            needed = torch.where(beyond, diff / budget_unit.reshape(-1), 0.0)
            figures.max_factor = max(figures.max_factor, float(needed.max()))
    row_squares = diff.view(-1, length).square().sum(dim=1)
    figures.diff_squares += float(row_squares.sum())
    clean_e = e if clean or bool(e_finite.all()) else torch.where(e_finite, e, 0.0)
    row_norms = clean_e.view(-1, length).square().sum(dim=1)
    figures.expected_squares += float(row_norms.sum())

    rows_bad = bad.view(-1, length).any(dim=1) if chunk_bad else None
    if rows_bad is not None:
        figures.count_failing_rows(rows_bad)
        _track_worst(figures, bad, finite, diff, ratio, a, e, bound)

    yardstick_rows = None
    if yardstick is not None:
        y = yardstick.detach().reshape(-1).double()
        y_diff = (y - e).abs_()
        if not clean or not bool(y_diff.isfinite().all()):
            y_diff = torch.where(y.isfinite() & e_finite, y_diff, 0.0)
        if y_diff.numel():
            figures.yardstick_max = max(figures.yardstick_max, float(y_diff.max()))
        yardstick_rows = y_diff.view(-1, length).square().sum(dim=1)
        figures.yardstick_squares += float(yardstick_rows.sum())
    if invalid_rows is not None:
        invalid = invalid_rows.reshape(-1)
        _track_rows(
            figures, invalid, rows_bad, bad, a, finite, row_squares, row_norms, yardstick_rows,
            clean,
        )  # fmt: skip
    figures.offset += a.numel()


def _track_max_abs(
    figures: RunningFigures,
    diff: torch.Tensor,
    a: torch.Tensor,
    e: torch.Tensor,
    bound: torch.Tensor,
) -> None:
    if diff.numel() == 0:
        return
    value, index = diff.max(dim=0)
    if float(value) > figures.max_abs[0]:
        i = int(index)
        figures.max_abs = (
            float(value),
            figures.offset + i,
            float(a[i]),
            float(e[i]),
            float(bound[i]),
        )


def _track_worst(
    figures: RunningFigures,
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

    length = figures.row_length
    measure = ratio if figures.rank_by_ratio else diff
    score = torch.where(bad, torch.where(finite, measure, math.inf), -1.0)
    row_score, row_channel = score.view(-1, length).max(dim=1)
    bad_rows = (row_score >= 0).nonzero().squeeze(1)
    if not bad_rows.numel():
        return
    # Stable sort: among equal scores the earliest rows win, whatever the chunking.
    order = row_score[bad_rows].sort(descending=True, stable=True).indices[:WORST_ROWS]
    for row in bad_rows[order].tolist():
        flat = row * length + int(row_channel[row])
        figures.keep_worst((
            float(row_score[row]), -(figures.offset + flat), float(a[flat]), float(e[flat]),
            float(bound[flat]),
        ))  # fmt: skip


def _track_rows(
    figures: RunningFigures,
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
    length = figures.row_length
    any_invalid = bool(invalid.any())
    figures.count_mismatched_invalid_rows(rows_bad, invalid)
    if rows_bad is not None and any_invalid:
        padded_bad = bad.view(-1, length)[invalid]
        padded_finite = finite.view(-1, length)[invalid]
        figures.beyond_in_invalid_rows += int((padded_bad & padded_finite).sum())
        figures.nonfinite_in_invalid_rows += int((padded_bad & ~padded_finite).sum())
    figures.add_padding(padding_of(a.view(-1, length)[invalid]) if any_invalid else None)
    usable = ~invalid & (row_norms > 0)
    if not clean:
        usable &= finite.view(-1, length).all(dim=1)
    figures.add_row_errors(usable, row_squares, row_norms, yardstick_rows)


def update_many(
    figures: Sequence[RunningFigures],
    actual: torch.Tensor,
    expected: torch.Tensor,
    rtol: float,
    atol: float,
) -> list[bool]:
    """:meth:`Comparison.update_many` of fresh ``figures`` of one shape, within
    ``atol + rtol * |expected|``: each figure here is the one :func:`update_general`
    computes, by the same operations, row by row."""
    import torch

    count, length = len(figures), figures[0].row_length
    a, e = actual.detach().double(), expected.detach().double()
    diff = (a - e).abs_()
    bound = e.abs().mul_(rtol).add_(atol)
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
    for tensor, (ok, *passing) in zip(figures, columns, strict=True):
        if ok:
            _add_passing(tensor, *passing)
    return fed.tolist()


def _add_passing(
    figures: RunningFigures,
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
    """Record a whole tensor compared by :func:`update_many`: finite, and within tolerance
    everywhere (so no mismatch, no worst row to keep)."""
    if figures.offset:
        raise ValueError("update_many takes whole tensors, to comparisons not yet fed")
    figures.max_abs = (max_abs, max_abs_index, max_abs_actual, max_abs_expected, max_abs_bound)
    figures.max_rel = (max_rel, max_rel_index)
    figures.max_ratio = max(figures.max_ratio, max_ratio)
    figures.diff_squares += diff_squares
    figures.expected_squares += expected_squares
    figures.offset = figures.numel
