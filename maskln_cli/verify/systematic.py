"""Systematic error: the structure rounding does not have, found where magnitude cannot tell.

A correct kernel's rounding is noise: row by row its error has no preferred sign, and averaged
over a million elements it vanishes. A formula or eps mistake is systematic: every row's
normalized values scaled by a factor of the same sign (a wrong eps, a wrong variance, an output
scaled by 1 + 1e-5), or shifted. At wide rows the budget (which grows with sqrt(C)) can hide
such a mistake; its structure cannot hide.

Each valid row's error ``e = RESULT - truth`` is regressed on the truth's own shape and on 1:
``e ~ f_r * z + g_r``, with ``z = xhat * scale`` for out and ``z`` the true grad_x for grad_x
(:func:`fit_rows`). A mistake in the normalization, ``xhat' = k(var) * xhat``, gives both the
same factor ``f_r = k - 1`` on each row (grad_x's other change is orthogonal to it). The sums
over rows, grad_scale and grad_bias, are regressed element by element on their truth
(:func:`fit_elements`). The factors ``f_r`` (and shifts ``g_r``) are pooled over rows (or
elements), weighted by how well each determines them, and compared with their standard error,
estimated from their spread (rows are independent, whatever the rounding inside a row): a
mistake stands out by orders of magnitude, rounding by a few standard errors at most. A pooled
factor is called systematic only when the rows also agree on it (what the best model of it
leaves unexplained is a small share of it: :data:`AGREEMENT`) and it is larger than what a
correct kernel may err systematically (:func:`systematic_gate`: a few units of the rounding and
the second-order rounding of the rows' statistics), so that the biases of a correct kernel's
rounding never fail it.

The models of the rows' factors (one common factor, another eps, a normalization mistake of
the catalogue) are :mod:`maskln_cli.verify.factor_models`'s.

With fewer than :data:`MIN_ROWS` rows the spread gives no credible standard error: the factor
is then systematic only beyond what any single row of a correct kernel errs by
(:data:`FEW_ROWS_ULPS`), and the finding says how large a factor went untested (``limit``).

The sums are accumulated block by block (:meth:`FitSums.add`), in a fixed order, in float64.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING

import torch

from maskln_cli.verify.factor_models import explain_factors
from maskln_cli.verify.terms import TermFinding, TermSums, pooled_terms, sums_of, term_gate

if TYPE_CHECKING:
    from maskln_cli.verify.budget import Precision

SYSTEMATIC_Z = 8.0
"""A pooled coefficient is systematic beyond this many standard errors (and its gate)."""
ROUNDING_Z = 4.0
"""The truth's own rounding is noise within this many standard errors of 0 (half the
SYSTEMATIC_Z a mistake must pass: rounding is called systematic readily, as the safe side)."""
AGREEMENT = 0.25
"""Rows agree on a factor (or shift) when what its best model leaves unexplained (the spread
about a common factor, or about eps's curve) is below this share of it. A mistake gives every
row the factor its model predicts; a rounding bias, such as a float32 sequential sum's of
65,536 squares (which loses about 7e-6 of the variance), comes with a spread from row to row as
large as half of it, which no model explains."""
SYSTEMATIC_ULPS = 16.0
"""What a correct kernel may err systematically, in units of its reductions' rounding: a
biased square root or division errs by a fraction of an ulp on every row."""
MIN_ROWS = 8
"""Fewer rows give no credible standard error: the few-rows gate applies instead."""
FEW_ROWS_ULPS = 1.0
"""With fewer than MIN_ROWS rows, a factor is systematic only beyond this many times
``sqrt(C)`` units of the reductions' rounding: the most a single row of a correct kernel errs
by is about a third of it (a float32 sequential sum: 0.25 at C = 4,096, Welford's 0.3;
benchmarks/verify_calibration.py --systematic)."""
STORED_SHARE = 0.25
"""An element of a sum whose stored rounding (half its dtype's spacing there) is beyond this
share of it is left out of the regression: a subnormal's few bits say nothing of a factor."""
SUM_AGREEMENT = 1.0
"""The elements of a sum over rows agree on a factor when their spread is below this share of
it. Each element's factor averages the rows' (weighted by the terms it sums), so rows of
different variance, whose factors a mistake makes differ, spread the elements' too; a sum's
factor must instead exceed what one row of a correct kernel errs by (as with few rows)."""
FEW_ROWS_CHANNELS = 8
"""With fewer than MIN_ROWS rows, rows of fewer channels are not tested (their rounding, in a
half dtype, comes as large as any factor a mistake of theirs hides below the budget: 6 valid
rows of F.layer_norm in float16 at C = 4 reached 2.7 times twice the gate); it is said."""
ALWAYS_REPORT = False
"""Report the pooled regressions of every tensor, systematic or not (read when a tensor is
explained; benchmarks/verify_calibration.py turns it on, to show how far from systematic the
correct kernels stay)."""
FEW_AGREED = 3
"""Distinct rows that must agree closely for half the few-rows threshold to suffice."""
TIGHT = 0.1
"""Few rows agree closely when their factors' spread is at most this share of the factor."""
KEPT_ROWS = 1 << 16
"""Rows whose factors are kept, to tell the models apart on, and to judge each row alone:
``(f_r, var + eps, weight, modelled noise, stored rounding relative to the row's normalized
part, second-order rounding, row index)``."""
ROW_LIMIT = 1.5
"""With fewer than MIN_ROWS distinct rows, a single row's factor is systematic beyond this many
times what one row of a correct kernel errs by (:func:`row_bound`): a mistake on one row (a
tail row, a grid's last block) shows in no pooled factor of several. One row of a correct
kernel reaches 0.63 of its bound at most in sets of 6 rows (Welford's, C = 16 to 65,536: 1.3
over 4,096 rows; benchmarks/verify_calibration.py --rows)."""
ROW_RISE = 6
"""With more rows the limit grows as their greatest rounding does, ``sqrt(ln N / ln 6)`` times
(as the greatest of N normal deviates: 1.3 of the bound seen over 4,096 rows, where the limit
is 3.2)."""
ROW_ULPS = 4.0
"""The floor of a row's gate when the row is judged alone, in units of the reductions'
rounding (the pooled gate's is :data:`SYSTEMATIC_ULPS`): one row's rstd rounds by an ulp or
two, and its sums' rounding is in its bound already (``sqrt(C)`` units, and its modelled
noise). At the pooled floor a row scaled by 5e-6 (eps outside the square root on a row of
unit variance) passed among 1,024 rows of C = 64; correct kernels' rows reach 0.35 of their
limit at most either way (benchmarks/verify_calibration.py --rows)."""
ROWS_ALONE = 4
"""Rows judged alone are said systematic when this many at most are beyond their limit, and
not every one: a mistake on a tail row, a grid's last block; more only when their factors
agree (:data:`AGREEMENT`), as a tail row in every block does and a coarser dtype's rounding
of many rows does not."""
ROW_CHANNELS = 16
"""Rows of fewer channels are not judged alone (a half dtype's rounding of a row of 8 is as
large as the factors it would be judged by: 8 times its bound seen)."""


@dataclass
class FitSums:
    """Running sums of the per-row regressions, pooled over rows (python floats, float64)."""

    rows: int = 0
    w: float = 0.0  # weights of the factors f_r: the rows' centered energy of z
    wf: float = 0.0
    wff: float = 0.0
    w2: float = 0.0
    w2f: float = 0.0
    w2ff: float = 0.0
    v: float = 0.0  # weights of the shifts g_r
    vg: float = 0.0
    vgg: float = 0.0
    v2: float = 0.0
    v2g: float = 0.0
    v2gg: float = 0.0
    we2: float = 0.0  # the rows' second-order rounding, weighted as the factors
    va: float = 0.0  # the rows' offsets A (mean |x| * rstd), weighted as the shifts
    vd: float = 0.0  # the rows' running-mean drifts (out's), weighted as the shifts
    wn: float = 0.0  # the rows' modelled rounding noise of their factors, weighted as them
    zz: float = 0.0  # the rows' sum of z**2, uncentered (0: elements, whose w is that)
    ws: float = 0.0  # the rows' stored rounding relative to their normalized part, likewise
    # The factors of the truth's own rounding to the stored dtype, weighted as the rows' (half
    # dtypes only; rounding_rows 0: not measured): is rounding systematic on these rows?
    rounding_rows: int = 0
    rwf: float = 0.0
    rw2f: float = 0.0
    rw2ff: float = 0.0
    sources: int = 0  # the valid rows a sum over rows sums (fit_elements); 0 for rows
    # A sum's elements: PyTorch's own errors on them (the yardstick's), relative to each,
    # weighted as the factors' standard error (w2pp) and their pooled factor (wp) are; and
    # how far a long sequential sum may shrink as a whole (drift).
    w2pp: float = 0.0
    wp: float = 0.0
    drift: float = 0.0
    # Each row's (f_r, var + eps, weight, ...: KEPT_ROWS), for the first KEPT_ROWS usable rows:
    # the models are told apart on them, and each row is judged alone.
    kept: list[torch.Tensor] = field(default_factory=list)
    kept_rows: int = 0
    terms: TermSums | None = None  # grad_x's: the backward's terms regressed (.terms)

    def finite(self) -> bool:
        """Whether every sum is finite: a row's energy squared (grad_x**4) overflows float64
        from |grad_x| of about 1e77 (float64 upstream gradients of 1e80 and more)."""
        return all(
            math.isfinite(getattr(self, item.name))
            for item in fields(self)
            if isinstance(getattr(self, item.name), float)
        )

    def distinct_rows(self) -> int:
        """The rows kept that are not copies of another, told by their variance (copies round
        their statistics alike); without kept rows (a sum's elements), ``rows``."""
        if not self.kept:
            return self.rows
        return len(torch.unique(torch.cat(self.kept)[:, 1]))

    def add(self, other: FitSums) -> None:
        for item in fields(self):
            if item.name not in ("kept", "kept_rows", "sources", "terms", "drift"):
                setattr(self, item.name, getattr(self, item.name) + getattr(other, item.name))
        if other.terms is not None:
            if self.terms is None:
                self.terms = TermSums()
            self.terms.add(other.terms)
        for part in other.kept:
            room = KEPT_ROWS - self.kept_rows
            if room > 0:
                self.kept.append(part[:room])
                self.kept_rows += len(part[:room])


def fit_rows(
    error: torch.Tensor,
    z: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    second_order: torch.Tensor,
    rows: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    e0: float = 0.0,
    stored: torch.Tensor | None = None,
    first_row: int = 0,
    shifted: torch.Tensor | None = None,
    z_squares: torch.Tensor | None = None,
    rounding: torch.Tensor | None = None,
    row_sums: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    writable: bool = False,
    drift: torch.Tensor | None = None,
) -> FitSums:
    """The sums of rows ``[R, C]`` (float64): ``error`` is RESULT - truth, ``z`` the truth's
    shape (out: ``xhat * scale``; grad_x: the true grad_x), ``rstd`` ``[R]`` the truth's 1 /
    sqrt(var + eps), ``second_order`` ``[R]`` each row's modelled second-order rounding
    (budget's e2), ``rows`` ``[R]`` the rows to fit (None: all; rows whose sums are not finite
    are left out), ``offset`` ``[R]`` each row's mean ``|x| * rstd`` (budget's A; None: 0)
    and ``e0`` its relative rounding per unit of A (budget's e0), ``stored`` ``[R]`` the rms
    rounding of each row's stored values (None: 0). From these each row's factor gets the
    noise a correct kernel's rounding gives it (``wn``): xhat errs by ``A * e0`` an element,
    relative to xhat's own size ``sqrt(var / (var + eps))``, which eps makes small; and a row
    stored with a large bias rounds by more than its small normalized part. ``shifted``
    (``[C]``; out: scale) is the shape the error takes when the row's mean rounds: xhat shifted
    by ``A * e0`` on every element at once, which no averaging over the row shrinks, and which a
    scale that varies by channel makes partly like z (the share regressed on z adds to the
    noise: an offset row of 16 channels of a correct float32 kernel reached twice its bound
    without it). ``z_squares`` ``[R]``: each row's sum of ``z**2``, when the caller has it.
    ``rounding`` ``[R, C]``: the truth rounded to the stored dtype, minus the truth, whose
    factors are pooled alike (:func:`rounding_is_noise`). ``row_sums``: each row's sums of
    ``z``, ``error`` and ``z * error`` ``[R]``, when the caller has them. ``writable``: ``z``
    and ``error`` are the caller's to give (made in place: the same bits, a pass in place
    where a new buffer costs about three times as much). ``drift`` ``[R]`` (with ``offset``):
    each row's shift of xhat by a running mean's rounding beyond ``A * e0``
    (:func:`~maskln_cli.verify.drift.running_mean_drift`), alike on rows of one offset, so
    that it is allowed to pooled shifts as well as added to the factors' noise.

    Example:
        >>> import torch
        >>> z = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 1.0, 1.0]], dtype=torch.float64)
        >>> sums = fit_rows(1e-3 * z + 2e-4, z, torch.ones(2, dtype=torch.float64), 1e-5,
        ...                 torch.zeros(2, dtype=torch.float64))
        >>> round(sums.wf / sums.w, 12), round(sums.vg / sums.v, 12)
        (0.001, 0.0002)
    """
    sums = FitSums()
    channels = z.shape[-1]
    if channels < 2 or not len(z):
        return sums
    zs = None  # each row's sum of z * shifted, made before z is written
    if writable and z_squares is None and row_sums is None and rounding is None:
        sz, se = z.sum(dim=1), error.sum(dim=1)
        sze = error.mul_(z).sum(dim=1)  # z * error: the same bits either way round
        if offset is not None and shifted is not None:
            zs = (z * shifted).sum(dim=1)
        szz = z.square_().sum(dim=1)
    else:
        szz = z.square().sum(dim=1) if z_squares is None else z_squares
        if row_sums is None:
            sz, se, sze = z.sum(dim=1), error.sum(dim=1), (z * error).sum(dim=1)
        else:
            sz, se, sze = row_sums
    det = szz * channels - sz.square()
    # The rows' figures stacked: tested for NaN and inf at once, and the usable rows gathered
    # at once (by index: a boolean mask's gather is several calls a tensor). Every value is
    # computed as it would be apart, element by element.
    figures = [sz, szz, se, sze, det, second_order]
    if offset is not None:
        figures.append(offset)
        if drift is not None:
            figures.append(drift)
        if shifted is not None:  # each row's sum of z * shifted
            figures.append((z * shifted).sum(dim=1) if zs is None else zs)
    if stored is not None:
        figures.append(stored)
    table = torch.stack(figures)
    usable = table[2:6].isfinite().all(dim=0) & (det > 1e-12 * szz * channels)
    if rows is not None:
        usable &= rows
    kept = usable.nonzero().squeeze(1)
    if not kept.numel():
        return sums
    sz, szz, se, sze, det, second, *more = table.index_select(1, kept).unbind(0)
    f = (sze * channels - sz * se) / det
    g = (szz * se - sz * sze) / det
    w = det / channels  # sum of (z - mean z)**2: how well the row determines f
    v = det / szz  # C - (sum z)**2 / sum z**2: how well it determines g
    sums.rows = kept.numel()
    f2, g2, w2, v2 = f.square(), g.square(), w.square(), v.square()
    columns = [w, w * f, w * f2, w2, w2 * f, w2 * f2, v, v * g, v * g2, v2, v2 * g, v2 * g2]
    columns.append(w * second)
    if rounding is not None:
        rounded = rounding.index_select(0, kept)
        fr = (
            rounded.mul(z.index_select(0, kept)).sum(dim=1) * channels - sz * rounded.sum(dim=1)
        ) / det
        sums.rounding_rows = sums.rows
        columns += [w * fr, w.square() * fr**1, w.square() * fr**2]
    rstd_kept = rstd.index_select(0, kept)
    noise = torch.zeros_like(f)
    if offset is not None:
        offset_kept = more.pop(0)
        columns.append(v * offset_kept)
        moved = offset_kept * e0  # xhat's shift: the mean's rounding, and a running mean's
        if drift is not None:
            drift_kept = more.pop(0)
            columns.append(v * drift_kept)
            moved = moved + drift_kept
        xhat_energy = (1 - eps * rstd_kept.square()).clamp_min(0) * channels
        noise = moved / xhat_energy.sqrt()
        if shifted is not None:
            zs, ss = more.pop(0), shifted.sum()
            noise += moved * ((zs * channels - sz * ss) / det).abs()
        if stored is not None:
            noise += more[0] / w.sqrt()
        columns.append(w * noise)
    relative_stored = torch.zeros_like(f)
    if stored is not None:
        # Rounding to the stored dtype biases a row's factor by up to its stored rounding over
        # the size of its normalized part: a bias far larger than that part (var far below
        # eps) erases it, a factor of -1, whatever the kernel. Its size is its spread over
        # the row (what determines a factor, w), not its mean: RMSNorm's rows about a common
        # offset are about -1 on every element, rounded by more than their spread.
        relative_stored = more[0] / (w / channels).sqrt()
        columns.append(w * relative_stored)
    # Every sum in one reduction (sums_of: each as alone), in the order of the columns; the
    # rows' energy of z last (what a common factor of theirs is a share of, uncentered).
    *found, sums.zz = sums_of(*columns, szz)
    (
        sums.w, sums.wf, sums.wff, sums.w2, sums.w2f, sums.w2ff,
        sums.v, sums.vg, sums.vgg, sums.v2, sums.v2g, sums.v2gg, sums.we2,
    ) = found[:13]  # fmt: skip
    found = found[13:]
    if rounding is not None:
        (sums.rwf, sums.rw2f, sums.rw2ff), found = found[:3], found[3:]
    if offset is not None and drift is not None:
        (sums.va, sums.vd, sums.wn), found = found[:3], found[3:]
    elif offset is not None:
        (sums.va, sums.wn), found = found[:2], found[2:]
    if stored is not None:
        sums.ws = found[0]
    spread = rstd_kept.square().reciprocal()  # var + eps
    index = kept.double() + first_row
    columns = [f, spread, w, noise, relative_stored, second, index]
    sums.kept = [torch.stack(columns, dim=1)]
    sums.kept_rows = len(f)
    return sums


def fit_elements(
    error: torch.Tensor,
    truth: torch.Tensor,
    second_order: float = 0.0,
    terms: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    sources: int = 0,
    spacing: torch.Tensor | None = None,
    peer: torch.Tensor | None = None,
    drift: float = 0.0,
) -> FitSums:
    """The sums of a sum over rows (grad_scale, grad_bias: ``[C]``, float64), each element a
    regression of its own: ``error_c ~ f * truth_c``, weighted by ``truth_c**2``. Elements
    that are not finite, whose truth is 0, or (given ``terms``, the norm of the terms each
    sums) whose truth is the near-cancellation of its terms, below :data:`CANCELLED` of them,
    are left out (their rounding, relative to them, is unbounded); there is no shift.
    ``noise`` is each element's modelled first-order rounding (the budget's, from the rows'
    statistics), ``sources`` the number of valid rows summed: the elements of a sum over few
    rows share those rows' rounding, and are no more independent than the rows are. ``spacing``:
    the stored dtype's spacing at each element (``granularity.grid_spacing``): elements it
    rounds by more than :data:`STORED_SHARE` of themselves (a float16 grad_scale of 1e-10
    rounds to 0) are left out too; and an element holding most of the weight weighs as much as
    the others together (an outlier channel's grad_scale, 97 % of it, a cancelling sum that
    PyTorch's float16 backward rounds by 2 u, would be the factor, its rounding no common one).
    ``peer`` is PyTorch's own error on each element (the yardstick's, a correct kernel's on
    these very rows), ``drift`` how far a long sequential sum may shrink as a whole
    (:meth:`~maskln_cli.verify.budget.SumBudget.stagnation`): PyTorch's bfloat16 grad_scale
    over 10,000 rows erred by 16 % an element, its 8 elements agreeing on -8.7 %, and its
    grad_bias of an upstream gradient of ones stops at 256 (0.13 of the truth at 2,000 rows).

    Example:
        >>> import torch
        >>> truth = torch.tensor([1.0, -2.0, 3.0, 0.0], dtype=torch.float64)
        >>> sums = fit_elements(truth * 1e-5, truth)
        >>> sums.rows, round(sums.wf / sums.w, 12)
        (3, 1e-05)
    """
    sums = FitSums()
    usable = truth.isfinite() & error.isfinite() & (truth != 0)
    if terms is not None:
        usable &= truth.abs() >= CANCELLED * terms
    if spacing is not None:
        usable &= spacing <= 2 * STORED_SHARE * truth.abs()
    if not bool(usable.any()):
        return sums
    t, e = truth[usable], error[usable]
    f, w = e / t, t.square()
    heaviest = int(w.argmax())
    others = float(w.sum() - w[heaviest])
    if len(w) > 1 and float(w[heaviest]) > others:
        # One element most of the weight would be the factor, its own rounding no common
        # factor: it weighs as much as all the others together, no more.
        w = w.clone()
        w[heaviest] = others
    sums.rows = int(usable.sum())
    sums.w, sums.wf, sums.wff = (float((w * f**k).sum()) for k in (0, 1, 2))
    sums.w2, sums.w2f, sums.w2ff = (float((w.square() * f**k).sum()) for k in (0, 1, 2))
    sums.we2 = second_order * sums.w
    if noise is not None:
        sums.wn = float((w * noise[usable] / t.abs()).sum())
    if peer is not None:
        relative = (w * peer[usable] / t).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        sums.w2pp, sums.wp = float(relative.square().sum()), float(relative.sum())
    sums.drift = drift
    sums.sources = sources
    return sums


PEER_Z = 4.0
"""A sum's factor must exceed this many standard errors of PyTorch's own elements' rounding
on the same rows (another order of the same sequential sum errs as much, not the same)."""
PEER_OWN = 3.0
"""PyTorch's standard error counts up to this many times RESULT's own: a result whose elements
agree far more closely than PyTorch's rounding lets them did not round like it."""
PEER_SHARE = 2.0
"""A sum shrunk (a negative factor) must have shrunk more than this many times PyTorch's own
sum has on the same rows (bfloat16 ones added one by one stop at 256)."""
CANCELLED = 0.1
"""A sum's element is regressed on only when its truth is at least this share of the norm of
the terms it sums (a random-sign sum's is about 1)."""


@dataclass
class Finding:
    """What the pooled regressions say: the factor and shift with their standard errors,
    whether either is systematic, what explains the factors (``model``: ``factor``, one common
    factor; ``eps``, another eps, ``eps`` or ``eps_at_most`` giving it; or a mistake's name of
    the catalogue) and, with fewer than MIN_ROWS rows, the smallest factor that could have been
    told from rounding (``limit``)."""

    rows: int
    factor: float
    factor_error: float
    shift: float
    shift_error: float
    gate: float
    systematic_factor: bool
    systematic_shift: bool
    eps: float | None = None
    eps_at_most: float | None = None
    score: float = 0.0  # |factor| over what it must exceed to be systematic (> 1: it is)
    model: str = "factor"
    unit: str = "rows"  # what was regressed: "rows" (out, grad_x) or "elements" (the sums)
    limit: float | None = None
    of: int | None = None  # the valid rows, when only a sample of them was regressed
    terms: TermFinding | None = None  # grad_x's: its backward's terms (.terms)
    # Each row judged alone (ROW_LIMIT): the greatest |f_r| over its bound, and when it is
    # beyond, that row (its index, factor and bound) and how many rows are.
    row_score: float = 0.0
    rows_beyond: int = 0
    row: int | list[int] | None = None
    row_factor: float | None = None
    row_limit: float | None = None
    # The spread of the rows' (or elements') factors about the pooled one: beyond |1 + factor|
    # RESULT is no multiple of the truth, and a factor describes nothing.
    factor_spread: float = 0.0
    # The error's energy (sum of squares) the common factor and shift give the rows regressed
    # (or elements), and RESULT's beyond rounding over them (set by whoever measured it; None:
    # not known, or none beyond rounding).
    factor_energy: float = 0.0
    shift_energy: float = 0.0
    error_energy: float | None = None

    def share(self, energy: float) -> float:
        """The share of RESULT's error a factor's or shift's ``energy`` is (1: unknown)."""
        if self.error_energy is None or self.error_energy <= 0:
            return 1.0
        return min(1.0, energy / self.error_energy)

    @property
    def multiple(self) -> bool:
        """Whether RESULT is about ``1 + factor`` times the truth (its ratios to it spread by
        less than that multiple): a sum made of the wrong rows' xhat is not, whatever its
        pooled factor."""
        return self.factor_spread <= abs(1 + self.factor)

    @property
    def systematic(self) -> bool:
        constants = self.terms is not None and self.terms.systematic_constant
        return self.rounding_excluded or constants

    @property
    def rounding_excluded(self) -> bool:
        """Whether what is systematic is what no rounding gives: a pooled factor, shift or
        term, or rows scaled alone. grad_x's constants beyond each row's rounding alone
        (:attr:`TermFinding.systematic_constant`) are not: they are what a coarser dtype's
        rounding of c2 gives (c1 and c2 summed in float16)."""
        terms = self.terms is not None and self.terms.systematic_term
        return self.systematic_factor or self.systematic_shift or terms or self.rows_beyond > 0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)  # every field, in order

    def sentence(self) -> str:
        """``all 922 valid rows scaled by 1 - 4.5e-06 ± 2e-09: systematic, not rounding``"""
        what = f"all {self.rows:,} valid rows" if self.unit == "rows" else f"all {self.rows:,}"
        fewer = self.of is not None and self.of > self.rows
        if fewer and self.unit == "rows":  # a sample of them, or rows of one value left out
            what = f"all {self.rows:,} valid rows tested (of {self.of:,})"
        elif fewer:  # the elements regressed (a sum's nonzero ones), of the tensor's
            what = f"{self.rows:,} of {self.of:,}"
        if self.unit != "rows":
            what += " elements" if self.rows != 1 or fewer else " element"
        parts = []
        factor, shift = self.share(self.factor_energy), self.share(self.shift_energy)
        if (self.systematic_factor or self.systematic_shift) and max(factor, shift) < DESCRIBES:
            # A doubled bias: every row off alike, by its bias, of which the common shift (the
            # bias's mean) is a small part; neither a factor nor a shift describes it.
            kind, value = (
                ("shift", f"{self.shift:+.2g}") if self.systematic_shift and shift >= factor
                else ("factor", scaled(self.factor))
            )  # fmt: skip
            return (
                f"{what} off, by no common factor or shift (the {kind} {value} is"
                f" {max(factor, shift):.0%} of the error): systematic, not rounding"
            )
        if self.systematic_factor and not self.multiple:
            parts.append(
                f"{what} off, no multiple of the truth (their ratios to it"
                f" {scaled(self.factor)} ± {self.factor_spread:.1g})"
            )
        elif self.systematic_factor:
            parts.append(f"{what} scaled by {scaled(self.factor)} ± {self.factor_error:.1g}")
        if self.systematic_shift:
            parts.append(
                f"{'and ' if parts else f'{what} '}shifted by"
                f" {self.shift:+.2g} ± {self.shift_error:.1g}"
            )
        if self.terms is not None and self.terms.systematic:
            terms = self.terms.sentence(what)
            return terms if not parts else " ".join(parts) + "; " + terms.split(": ", 1)[1]
        if not parts and self.rows_beyond:
            assert self.row_factor is not None and self.row_limit is not None
            which = f"row {self.row}" if self.rows_beyond == 1 else (
                f"{self.rows_beyond:,} rows (row {self.row}"
            )  # fmt: skip
            return (
                f"{which} scaled by {scaled(self.row_factor)}"
                f"{'' if self.rows_beyond == 1 else ' the most)'}, where one row of a correct"
                f" kernel errs by {self.row_limit:.1g} at most: systematic, not rounding"
            )
        return " ".join(parts) + ": systematic, not rounding"


DESCRIBES = 0.5
"""A common factor or shift is said to be RESULT's error when it is at least this share of
the error's energy over the rows (or elements) regressed; else the error is said to be neither."""
PLAIN_FACTOR = 0.1
"""From this relative factor on, a scaling is said as its multiplier (0.14, not 1 - 0.86)."""


def scaled(factor: float) -> str:
    """A row's scaling ``1 + factor`` in words: ``1 - 4.5e-06`` (a small factor keeps its
    digits), ``0.14`` (a large one plainly).

    Example:
        >>> scaled(-4.5e-6), scaled(-0.86), scaled(0.5)
        ('1 - 4.5e-06', '0.14', '1.5')
    """
    if abs(factor) >= PLAIN_FACTOR:
        return f"{1 + factor:.3g}"
    return f"1 {'+' if factor >= 0 else '-'} {abs(factor):.2g}"


def rounding_is_noise(sums: FitSums) -> bool:
    """Whether the truth's own rounding to the stored dtype, pooled over the rows as their
    factors are, is within ROUNDING_Z of its standard error of 0 (False when not measured).

    Rows that repeat the same values (C = 2, rows quantized to a few values) round alike and
    agree on a factor of up to an ulp; rows of many distinct values round as noise (pooled over
    about 200 valid rows of 768 channels, a correct bfloat16 kernel's factor was within 1e-5
    of 0).
    """
    if sums.rounding_rows < MIN_ROWS or sums.w <= 0:
        return False
    factor = sums.rwf / sums.w
    spread = sums.rw2ff - 2 * factor * sums.rw2f + factor**2 * sums.w2
    return abs(factor) <= ROUNDING_Z * math.sqrt(max(0.0, spread)) / sums.w


def systematic_gate(
    precision: Precision, second_order: float, bias_to_scale: float, stored: float | None = None
) -> float:
    """How large a pooled relative factor a correct kernel in ``precision`` may show: a few
    units of its reductions' rounding; the rounding of its stored output, which on rows of
    nearly equal values (C of 2 to 16, in a half dtype) is as much systematic as not, by up to
    an ulp of the output, bias included (``bias_to_scale``: rms(bias) / rms(scale)); plus the
    rows' second-order rounding (a row mean off by d inflates the variance by d**2); and the
    rounding of parameters given finer than the kernel's dtype (float32 scale and bias of a
    .half() module): each channel's, the same on every row. ``stored``, when the rows give it,
    is their own stored rounding relative to their normalized part, which replaces the
    estimate from bias and scale.

    Example:
        >>> import torch
        >>> from maskln_cli.verify.budget import Precision
        >>> round(systematic_gate(Precision.of(torch.float32), 0.0, 1.0) / 2**-24)
        16
    """
    if stored is None:
        stored = precision.store * (1 + bias_to_scale)
    return max(SYSTEMATIC_ULPS * precision.reduce, 2 * stored, precision.params) + second_order


def pooled(
    sums: FitSums,
    precision: Precision,
    eps: float,
    scale_size: float,
    bias_size: float,
    channels: int = 0,
) -> Finding | None:
    """The pooled factor and shift and whether they are systematic (None: nothing to pool:
    no usable row, or fewer than MIN_ROWS elements of a sum). ``scale_size`` and
    ``bias_size`` are the rms of scale and bias: a shift is measured against the output's
    values, ``scale_size + bias_size`` (give 1 and 0 for a gradient). ``channels`` is C (the
    models and the few-rows gate need it); rows regressed with :func:`fit_elements` hold no
    kept rows."""
    if sums.rows < 1 or sums.w <= 0 or not sums.finite():
        return None  # nothing to pool, or sums beyond float64 (left untested)
    elements = not sums.kept and sums.v <= 0
    kept = torch.cat(sums.kept) if sums.kept else None  # each row's (f_r, var + eps, weight)
    if elements and sums.rows < MIN_ROWS:
        return None
    factor = sums.wf / sums.w
    factor_error = (
        math.sqrt(max(0.0, sums.w2ff - 2 * factor * sums.w2f + factor**2 * sums.w2)) / sums.w
    )
    shift, shift_error, shift_spread = 0.0, 0.0, 0.0
    if sums.v > 0:
        shift = sums.vg / sums.v
        shift_error = (
            math.sqrt(max(0.0, sums.v2gg - 2 * shift * sums.v2g + shift**2 * sums.v2)) / sums.v
        )
        shift_spread = math.sqrt(max(0.0, sums.vgg / sums.v - shift**2))
    ratio = bias_size / scale_size if scale_size > 0 else math.inf
    stored = sums.ws / sums.w if sums.ws > 0 else None
    gate = systematic_gate(precision, sums.we2 / sums.w, ratio, stored)
    # Where the truth's own rounding to the stored dtype is noise, so is a correct kernel's:
    # the stored rounding then earns the factor no allowance (only the shift keeps it).
    factor_gate = gate
    if not elements and rounding_is_noise(sums):
        factor_gate = systematic_gate(precision, sums.we2 / sums.w, ratio, 0.0)
    # Rows that are copies of each other round their statistics alike (whatever grad_out):
    # only distinct rows, told by their variance, are evidence.
    distinct = sums.distinct_rows()
    # Nor do rows whose weights one or two of them dominate: the spread of the others then
    # says nothing of the pooled factor's error (Kish's effective number of rows). A sum's
    # elements need no such rule: their threshold holds their modelled rounding already (and
    # one element weighs no more than the others together: fit_elements).
    effective = distinct
    if kept is not None and sums.w2 > 0:
        effective = min(distinct, sums.w**2 / sums.w2)
    few = effective < MIN_ROWS or (elements and sums.sources < MIN_ROWS)
    # What one row of a correct kernel may err by: the gate of few rows and of sums.
    one_row = max(gate, FEW_ROWS_ULPS * math.sqrt(max(channels, 1)) * precision.reduce)
    if few:  # without a standard error: twice the gate (6 rows of 16 channels of F.layer_norm
        one_row = max(one_row, 2 * gate)  # in float16 came within a quarter of it), and the
        one_row = max(one_row, sums.wn / sums.w)  # rows' modelled noise (a fifth of it seen)
        if channels < FEW_ROWS_CHANNELS:
            one_row = math.inf
    # Rows that agree closely (their spread a tenth of their factor at most, as rounding's
    # never is: a sequential sum's bias comes with a spread of half of it) are evidence even
    # below what one row may err by: half of it then suffices, from FEW_AGREED distinct rows.
    spread = math.sqrt(max(0.0, sums.wff / sums.w - factor**2))
    agreed = few and distinct >= FEW_AGREED and spread <= TIGHT * abs(factor)
    if agreed:
        one_row = max(one_row / 2, gate)
    model, eps_found, eps_at_most, left = "factor", None, None, None
    # The models only matter to a factor beyond the other thresholds (a passing run's is not).
    beyond = abs(factor) > (one_row if few else max(SYSTEMATIC_Z * factor_error, factor_gate))
    if kept is not None and (beyond or ALWAYS_REPORT):
        model, eps_found, eps_at_most, left = explain_factors(kept, eps, channels)
    factor_spread = math.sqrt(max(0.0, sums.wff / sums.w - factor**2)) if left is None else left
    limit = one_row if few else None
    if few:  # no credible standard error
        threshold = max(one_row, factor_spread / AGREEMENT)
        same_sign = bool((kept[:, 0] * factor > 0).all()) if kept is not None else True
        systematic_factor = abs(factor) > threshold and same_sign
    elif elements:
        # The rows' first-order rounding, each row's own, averages over the rows summed.
        noise = sums.wn / sums.w / math.sqrt(max(sums.sources, 1))
        # What PyTorch's own sums err by on these rows, where RESULT's elements spread as
        # much: PEER_Z standard errors of PyTorch's elements' rounding, at most PEER_OWN of
        # RESULT's own (8 elements of PyTorch's agreed on -8.7 % by chance; a kernel summing
        # in float32 and scaled by 1.05 spreads by 1e-8, and PyTorch's rounding is no
        # excuse for it). A sum shrinks by stagnating: PEER_SHARE times PyTorch's own
        # shrinking, and a long sum's (PyTorch's yardstick sums a chunk of rows at a time).
        peer_factor = sums.wp / sums.w
        peer = PEER_Z * min(math.sqrt(sums.w2pp) / sums.w, PEER_OWN * factor_error)
        if factor < 0:
            peer = max(peer, PEER_SHARE * -min(peer_factor, 0.0)) + sums.drift
        noise = max(noise, peer)
        threshold = max(SYSTEMATIC_Z * factor_error, one_row, factor_spread / SUM_AGREEMENT, noise)
        systematic_factor = abs(factor) > threshold
    else:
        threshold = max(SYSTEMATIC_Z * factor_error, factor_gate, factor_spread / AGREEMENT)
        systematic_factor = abs(factor) > threshold
    systematic_shift = False
    if sums.v > 0:
        shift_gate = (limit if few else gate) * (scale_size + bias_size)  # type: ignore[operator]
        if few:  # a row's mean, rounded, shifts the row by A * e0 of its spread (the budget's
            e0 = math.sqrt(max(channels, 1)) * precision.reduce + precision.x  # first term):
            shift_gate += e0 * sums.va / sums.v * scale_size  # many rows' shifts spread
        # A running mean's drift is alike on rows of one offset: no number of rows averages it.
        shift_gate += sums.vd / sums.v * scale_size
        z = 0.0 if few else SYSTEMATIC_Z * shift_error
        systematic_shift = abs(shift) > max(z, shift_gate, shift_spread / AGREEMENT)
    finding = Finding(
        sums.rows, factor, factor_error, shift, shift_error, gate, systematic_factor,
        systematic_shift, score=abs(factor) / threshold if threshold > 0 else math.inf,
        unit="elements" if elements else "rows", limit=limit, factor_spread=spread,
        factor_energy=factor**2 * (sums.zz or sums.w),
        shift_energy=shift**2 * sums.v if sums.v > 0 else 0.0,
    )  # fmt: skip
    if kept is not None and channels >= ROW_CHANNELS:
        rise = math.sqrt(max(1.0, math.log(len(kept)) / math.log(ROW_RISE)))
        _judge_rows(finding, kept, precision, channels, ROW_LIMIT * rise)
        if systematic_factor or systematic_shift:
            finding.rows_beyond = 0  # the whole: said so
    if systematic_factor and not systematic_shift:
        finding.model, finding.eps, finding.eps_at_most = model, eps_found, eps_at_most
    if sums.terms is not None:
        finding.terms = pooled_terms(sums.terms, term_gate(precision, channels, sums.we2 / sums.w))
        if finding.terms is not None and finding.terms.model and not systematic_factor:
            finding.model = finding.terms.model
    return finding


def row_bound(kept: torch.Tensor, precision: Precision, channels: int) -> torch.Tensor:
    """What one row of a correct kernel may be scaled by, each kept row's own: twice its gate
    (as :func:`systematic_gate`'s, from its stored rounding and second-order rounding, but
    with a row's floor, :data:`ROW_ULPS`), ``sqrt(C)`` units of the reductions' rounding
    (:data:`FEW_ROWS_ULPS`), and its modelled noise: the threshold of a row's factor."""
    noise, stored, second_order = kept[:, 3], kept[:, 4], kept[:, 5]
    floor_of_gate = max(ROW_ULPS * precision.reduce, precision.params)
    gate = (2 * stored).clamp(min=floor_of_gate) + second_order  # as systematic_gate's
    floor = FEW_ROWS_ULPS * math.sqrt(channels) * precision.reduce
    return torch.maximum(torch.maximum(2 * gate, noise), torch.full_like(gate, floor))


def _agree(factors: torch.Tensor) -> bool:
    """Whether rows' factors share a sign and agree within :data:`AGREEMENT` of their mean."""
    mean = float(factors.mean())
    if not bool((factors * mean > 0).all()):
        return False
    return float(factors.std(correction=0)) <= AGREEMENT * abs(mean)


def _judge_rows(
    finding: Finding, kept: torch.Tensor, precision: Precision, channels: int, limit: float
) -> None:
    """Each kept row's factor against its own bound (:func:`row_bound`) times ``limit``: the
    finding's ``row_score``, and the rows beyond."""
    bound = row_bound(kept, precision, channels) * limit
    ratio = kept[:, 0].abs() / bound
    worst = int(ratio.argmax())
    finding.row_score = float(ratio[worst])
    beyond = ratio > 1
    count = int(beyond.sum())
    # Evidence of one row, or a few: where every row (or many) is beyond, what is wrong is
    # not a row's, and the budget and the pooled test say it; or of many rows that agree (a
    # block's tail row in every block), which no rounding does (a coarser dtype's scatters).
    if 0 < count < len(kept) and (count <= ROWS_ALONE or _agree(kept[beyond, 0])):
        finding.rows_beyond = count
        finding.row = int(kept[worst, 6])
        finding.row_factor, finding.row_limit = float(kept[worst, 0]), float(bound[worst])
