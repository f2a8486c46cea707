"""The backward's terms, tested for a systematic error: a term dropped or miscounted shows on
every row, however small the gradients and however loose the budget.

grad_x is ``rstd * (wdy - xhat * c1 - c2)``, with ``wdy = scale * grad_out``, ``c1 =
mean(xhat * wdy)`` and ``c2 = mean(wdy)``: three terms, the last two those a hand-written
backward drops (or autograd, when the variance or the mean is detached from the graph). Each
valid row's error ``e = RESULT - truth`` is regressed on the true grad_x and the row's own xhat
term ``t_xhat = rstd * xhat * c1`` and mean term ``t_mean = rstd * c2`` (:func:`fit_terms`):
``e ~ f * grad_x + a * t_xhat + b * t_mean``. A backward missing its xhat term gives ``a = 1``
on every row, one missing its mean term ``b = 1``; a correct kernel's rounding gives
coefficients of either sign from row to row, whose pool vanishes. The coefficients are pooled
over rows, each weighted by how well its row determines it, and judged as the systematic
factors of :mod:`.systematic` are (:func:`pooled_terms`): beyond 8 standard errors, a gate
and what their spread leaves unexplained. The models: a term missing (the coefficient 1, the
other 0), named; any other value is said in words.

The regression is relative to the terms themselves, so it does not depend on the gradients'
scale (a missing term at an upstream gradient of 1e-9 is as plain as at 1), and a row's
coefficients are exact where its budget is loose (rows with a large offset, wide rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from maskln_cli.verify.budget import Precision

TERMS = ("xhat", "mean")
"""The terms regressed on: grad_x's xhat term and its mean term."""
MISSING = {"xhat": "backward_missing_xhat_term", "mean": "backward_missing_mean_term"}
"""The catalogue's mistake of a term missing (its coefficient 1), by term."""
SYSTEMATIC_Z = 8.0
"""A pooled coefficient is systematic beyond this many standard errors (and the gate)."""
AGREEMENT = 0.25
"""Rows agree on a coefficient when their spread about it is below this share of it (or the
few-rows threshold, :data:`FEW_ROWS_TERM`, when it is greater)."""
TERM_ULPS = 64.0
"""What a correct kernel's pooled coefficient may be biased by, in units of its reductions'
rounding (``sqrt(C)`` of them at most, each row's statistics' rounding biased alike; a factor
error of rstd moves the xhat term twice): far below any term dropped or miscounted by 1 / C."""
FEW_ROWS = 8
"""With fewer distinct rows the spread gives no credible standard error."""
FEW_ROWS_TERM = 0.1
"""With few rows a coefficient is systematic beyond this (a term missing is 1; a correct
kernel's, on one row, its relative rounding of that term: far below)."""
CONSTANT_LIMIT = 0.25
"""Rows' constants are systematic when their rms over the rows is beyond this share of each
row's bound (:func:`constant_bounds`), from FEW_ROWS distinct rows."""
MODEL_AGREEMENT = 0.05
"""A term is named missing when its coefficient is within this of 1 and the other's of 0."""


def sums_of(*columns: torch.Tensor) -> list[float]:
    """The sums of ``columns`` (``[R]`` each), in one reduction over their stack rather than
    one call (and one float) each: the same bits at one thread (each is summed along its own
    contiguous row, as alone); where torch splits a long sum between threads, as in rounding.

    Example:
        >>> sums_of(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]))
        [3.0, 7.0]
    """
    return torch.stack(columns).sum(dim=1).tolist()


@dataclass
class Pool:
    """Running sums of one coefficient over rows: weights w, and w times the coefficient (and
    its square), and those with w squared (for the standard error)."""

    w: float = 0.0
    wa: float = 0.0
    waa: float = 0.0
    w2: float = 0.0
    w2a: float = 0.0
    w2aa: float = 0.0
    wn: float = 0.0  # w times each row's modelled rounding noise of its coefficient
    n: float = 0.0  # the rows summed (each sum's float64 rounding grows with them)

    def add(self, other: Pool) -> None:
        for item in fields(self):
            setattr(self, item.name, getattr(self, item.name) + getattr(other, item.name))

    @classmethod
    def of(cls, a: torch.Tensor, w: torch.Tensor, noise: torch.Tensor) -> Pool:
        return cls(*sums_of(*cls.columns(a, w, noise)), float(len(a)))

    @staticmethod
    def columns(a: torch.Tensor, w: torch.Tensor, noise: torch.Tensor) -> list[torch.Tensor]:
        """What :meth:`of` sums over rows (its fields but ``n``, in order), from each row's
        coefficient ``a``, weight ``w`` and modelled noise ``[R]``."""
        a2, w2 = a.square(), w.square()
        return [w, w * a, w * a2, w2, w2 * a, w2 * a2, w * noise]

    def noise(self) -> float:
        """The rows' modelled rounding noise of the coefficient, weighted as it is."""
        return self.wn / self.w if self.w > 0 else math.inf

    def mean(self) -> float:
        return self.wa / self.w if self.w > 0 else 0.0

    def effective_rows(self) -> float:
        """How many rows of equal weight the weights amount to, ``(sum w)**2 / sum w**2``."""
        return self.w**2 / self.w2 if self.w2 > 0 else 0.0

    def error(self) -> float:
        """The standard error of the pooled coefficient, from the rows' spread."""
        if not self.w > 0:
            return math.inf
        return pooled_error(self.w, self.w2, self.w2a, self.w2aa, self.mean(), self.n)

    def spread(self) -> float:
        """The weighted rms of the rows' coefficients about their mean."""
        a = self.mean()
        return math.sqrt(max(0.0, self.waa / self.w - a * a)) if self.w > 0 else 0.0


EPS64 = 2.0**-53
"""float64's unit roundoff."""


def pooled_error(w: float, w2: float, w2a: float, w2aa: float, mean: float, rows: float) -> float:
    """The standard error of a pooled coefficient ``mean`` (``sum w a / sum w``) from its sums
    over ``rows`` rows: ``sqrt(sum w**2 (a - mean)**2) / sum w``, as ``w2aa - 2 mean w2a +
    mean**2 w2``. Where the rows agree to float64's last bits (a term missing exactly), those
    three cancel, and what is left is their own rounding: each sum of ``rows`` terms errs by
    ``rows * eps64`` of the size of its terms at most (``sum w**2 |a| <= sqrt(w2 * w2aa)``).
    A spread within that bound is noise, not a standard error: 0.

    Example:
        >>> pooled_error(1.0, 1.0, 1.0, 1.0 + 2**-52, 1.0, 1)  # cancellation noise, not 1.5e-08
        0.0
        >>> round(pooled_error(1.0, 1.0, 1.0, 1.0 + 1e-6, 1.0, 1), 9)  # a spread of 1e-3
        0.001
    """
    spread = w2aa - 2 * mean * w2a + mean * mean * w2
    size = w2aa + 2 * abs(mean) * math.sqrt(max(0.0, w2 * w2aa)) + mean * mean * w2
    if spread <= (rows + 4) * EPS64 * size:
        return 0.0
    return math.sqrt(spread) / w


@dataclass
class TermSums:
    """The pooled regressions of grad_x's terms (:func:`fit_terms`), added block by block."""

    rows: int = 0
    pools: dict[str, Pool] = field(default_factory=lambda: {t: Pool() for t in TERMS})
    # The distinct rows seen (by their variance, up to FEW_ROWS + 1 of them): copies of a row
    # round alike and are one row of evidence.
    spreads: set[float] = field(default_factory=set)
    # Each row's constant (the mean of its error) over its bound (:func:`constant_bounds`):
    # the rows judged, the sum of the squares, the worst, and the rows beyond 1.
    constant_rows: int = 0
    constant_squares: float = 0.0
    constant_worst: float = 0.0
    constant_beyond: int = 0

    def add(self, other: TermSums) -> None:
        self.rows += other.rows
        self.constant_rows += other.constant_rows
        self.constant_squares += other.constant_squares
        self.constant_worst = max(self.constant_worst, other.constant_worst)
        self.constant_beyond += other.constant_beyond
        for name, pool in other.pools.items():
            self.pools[name].add(pool)
        if len(self.spreads) <= FEW_ROWS:
            self.spreads |= set(sorted(other.spreads)[: FEW_ROWS + 1])


def fit_terms(
    error: torch.Tensor,
    truth: torch.Tensor,
    xhat: torch.Tensor,
    wdy: torch.Tensor,
    rstd: torch.Tensor,
    rows: torch.Tensor,
    rounding: torch.Tensor | None = None,
    products: tuple[torch.Tensor, torch.Tensor] | None = None,
    floor: float | torch.Tensor = 0.0,
) -> TermSums:
    """The term regressions of rows ``[R, C]`` (float64): ``error`` is RESULT - truth,
    ``truth`` the true grad_x, ``xhat`` and ``wdy`` (``scale * grad_out``) the rows' own,
    ``rstd`` ``[R]``, ``rows`` ``[R]`` those to fit (rows whose figures are not finite are
    left out), ``rounding`` ``[R]`` the rms of a correct kernel's modelled rounding of each
    row (None: 0): a coefficient's noise is at most that row's rounding all along its term,
    ``rounding * sqrt(C / information)``. ``products``: the rows' :func:`row_products` of
    (truth, xhat, error, wdy), when the caller has them. ``floor``: what rounding moves each
    row alike beyond the rounding's rms (a float, or one per row ``[R]``): the stored dtype's
    rounding of its smallest values, half an ulp of its subnormals, and below the smallest
    normal the kernel computes in, c2's rounding (:func:`constant_bounds`).

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(16, 8, generator=g, dtype=torch.float64)
        >>> xhat = (x - x.mean(1, True)) / x.std(1, keepdim=True, correction=0)
        >>> wdy = torch.randn(16, 8, generator=g, dtype=torch.float64)
        >>> rstd, rows = torch.ones(16, dtype=torch.float64), torch.ones(16, dtype=torch.bool)
        >>> c1, c2 = (xhat * wdy).mean(1, True), wdy.mean(1, True)
        >>> dx = wdy - xhat * c1 - c2
        >>> sums = fit_terms(xhat * c1, dx, xhat, wdy, rstd, rows)
        >>> round(sums.pools["xhat"].mean(), 9), abs(round(sums.pools["mean"].mean(), 9))
        (1.0, 0.0)
    """
    sums = TermSums()
    channels = truth.shape[-1]
    if channels < 4 or not len(truth):
        return sums
    # The terms are the true grad_x, t_xhat = (rstd c1) xhat and t_mean = (rstd c2) 1: each
    # row's gram matrix and moments are its sums of truth, xhat and error (products and
    # plain), times those factors, from one batched product over rows (not a basis [R, C, 3]),
    # which gives c1 = mean(xhat wdy) and c2 = mean(wdy) too.
    all_products, all_plain = products or row_products(truth, xhat, error, wdy)
    c1, c2 = all_products[:, 1, 3] / channels, all_plain[:, 3] / channels
    products, plain = all_products[:, :3, :3], all_plain[:, :3]
    base = torch.empty_like(products)
    base[:, :2, :2] = products[:, :2, :2]
    base[:, :2, 2] = base[:, 2, :2] = plain[:, :2]
    base[:, 2, 2] = channels
    factors = torch.stack((torch.ones_like(c1), rstd * c1, rstd * c2), dim=1)  # [R, 3]
    gram = base.mul_(factors.unsqueeze(2)).mul_(factors.unsqueeze(1))  # [R, 3, 3]
    moment = torch.stack((products[:, 0, 2], products[:, 1, 2], plain[:, 2]), dim=1)
    moment.mul_(factors)  # [R, 3]
    figures = torch.cat((gram.reshape(-1, 9), moment), dim=1)  # tested for NaN and inf at once
    usable = rows & figures.isfinite().all(dim=1)
    # A row determines a coefficient when its term is not (nearly) a combination of the other
    # two: the information 1 / (gram^-1)_kk, against the term's own energy.
    scale = gram.diagonal(dim1=1, dim2=2).clamp_min(1e-300)
    norm = scale.sqrt()
    unit = gram / (norm.unsqueeze(2) * norm.unsqueeze(1))
    determinant = torch.linalg.det(torch.where(usable[:, None, None], unit, torch.eye(3)))
    usable &= determinant > 1e-9
    kept = usable.nonzero().squeeze(1)  # gathered by index: a mask's gather is several calls
    if not kept.numel():
        return sums
    unit, moment, norm, scale = (t.index_select(0, kept) for t in (unit, moment, norm, scale))
    inverse = torch.linalg.inv(unit)
    coefficients = (inverse @ (moment / norm).unsqueeze(2)).squeeze(2) / norm
    information = scale / inverse.diagonal(dim1=1, dim2=2)  # the weight of each coefficient
    sums.rows = kept.numel()
    spread_of_rounding = (
        rounding.index_select(0, kept).reshape(-1, 1) * math.sqrt(channels)
        if rounding is not None else None
    )  # fmt: skip
    columns: list[torch.Tensor] = []
    for k in range(1, len(TERMS) + 1):
        info = information[:, k]
        noise = (
            spread_of_rounding[:, 0] / info.sqrt() if spread_of_rounding is not None
            else torch.zeros_like(info)
        )  # fmt: skip
        columns += Pool.columns(coefficients[:, k], info, noise)
    # Both pools' sums in one reduction (sums_of: each as alone).
    found = sums_of(*columns)
    for k, name in enumerate(TERMS):
        sums.pools[name] = Pool(*found[k * 7 : k * 7 + 7], float(sums.rows))
    spread = rstd.index_select(0, kept).square().reciprocal()
    sums.spreads = set(spread.unique()[: FEW_ROWS + 1].tolist())
    if rounding is not None:
        ratio = all_plain[:, 2].index_select(0, kept).div(channels).abs()
        ratio /= constant_bounds(
            rounding.index_select(0, kept), c1.index_select(0, kept), c2.index_select(0, kept),
            all_products[:, 3, 3].index_select(0, kept), channels,
            floor.index_select(0, kept) if isinstance(floor, torch.Tensor) else floor,
        )  # fmt: skip
        ratio = ratio[ratio.isfinite()]
        if ratio.numel():
            sums.constant_rows = ratio.numel()
            sums.constant_squares = float(ratio.square().sum())
            sums.constant_worst = float(ratio.max())
            sums.constant_beyond = int((ratio > 1).sum())
    return sums


def constant_bounds(
    rounding: torch.Tensor,
    c1: torch.Tensor,
    c2: torch.Tensor,
    wdy_squares: torch.Tensor,
    channels: int,
    floor: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """What a correct kernel's rounding moves each row's grad_x by alike on every element (its
    constant), ``[R]``, from each row's modelled rounding of grad_x (rms, ``rounding``), its
    c1, c2 and sum of ``wdy**2``: the row's mean, shifted by ``s``, moves grad_x by ``rstd *
    s * c1`` alike, and by ``rstd * s * xhat * c2``; a running mean's drift, by ``rstd * s_j *
    c2`` (s_j each element's own), whose mean over the row is a constant too; c2's own
    rounding is one. Each is the rounding's ``rstd * s * rms(wdy)`` (its shift part) times
    ``n / rms(wdy)``, with ``n1 + n2 = |c1| + |c2| + 2 rms(wdy) / sqrt(C)`` (the sums' rounding
    per unit: docs/verify-budget.md, "The gradients' budget"). The rounding's other parts
    (stored, the backward's sums) are each element's own: averaged over the row, within
    ``2 * rounding / sqrt(C)`` (where the rounding is an ulp of a half dtype's subnormals, its
    own rounding's rms is 0.58 of it: 3.5 standard errors). But rounding to the nearest
    subnormal is not each element's own: where grad_x is a few of their ulps (float16 at an
    upstream gradient of 1e-6), its rounding erases part of each row's constant alike; that,
    ``floor``, half an ulp of the stored dtype's subnormals, is each element's bound alike
    (float32's 7e-46; 0: none); below the smallest normal of the dtype the kernel computes
    in, c2's own rounding, ``2 rstd u_sub``, is too (a float, or one per row ``[R]``).
    """
    wdy_rms = wdy_squares.div(channels).sqrt()
    n = c1.abs() + c2.abs() + 2 * wdy_rms / math.sqrt(channels)
    return rounding * (n / wdy_rms + 2 / math.sqrt(channels)) + floor


def row_products(
    truth: torch.Tensor, xhat: torch.Tensor, error: torch.Tensor, wdy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's sums of the products of its rows of ``truth``, ``xhat``, ``error`` and
    ``wdy`` ``[R, C]`` (float64), pair by pair, ``[R, 4, 4]``, and of each alone, ``[R, 4]``:
    in one batched product over rows, which reads each row once for all its pairs (their
    sums ``(a * b).sum(dim=1)`` read both rows once a pair).

    Example:
        >>> ones = torch.ones(1, 2, dtype=torch.float64)
        >>> products, plain = row_products(ones, 2 * ones, 3 * ones, 4 * ones)
        >>> products[0, 1].tolist(), plain[0].tolist()
        ([4.0, 8.0, 12.0, 16.0], [2.0, 4.0, 6.0, 8.0])
    """
    rows_of = torch.stack((truth, xhat, error, wdy), dim=1)  # [R, 4, C]
    return stacked_products(rows_of)


def stacked_products(rows_of: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`row_products` of rows already stacked ``[R, 4, C]``."""
    return rows_of @ rows_of.transpose(1, 2), rows_of.sum(dim=2)


@dataclass
class TermFinding:
    """What the pooled term regressions say: each term's coefficient and standard error,
    whether it is systematic, and the mistake they name (None: none)."""

    rows: int
    xhat_term: float
    xhat_term_error: float
    mean_term: float
    mean_term_error: float
    systematic_xhat_term: bool
    systematic_mean_term: bool
    gate: float
    model: str | None = None
    # Each row's constant over its bound (:func:`constant_bounds`): their rms over the rows,
    # the worst, and the rows beyond 1 (of constant_rows).
    constant_score: float = 0.0
    constant_worst: float = 0.0
    constant_beyond: int = 0
    constant_rows: int = 0
    systematic_constant: bool = False

    @property
    def systematic_term(self) -> bool:
        return self.systematic_xhat_term or self.systematic_mean_term

    @property
    def systematic(self) -> bool:
        return self.systematic_term or self.systematic_constant

    def sentence(self, rows: str) -> str:
        """``all 717 valid rows: grad_x's xhat term off by +1 ± 3e-07: systematic, not
        rounding``"""
        parts = [
            f"its {name} term off by {value:+.3g} ± {error:.1g}"
            for name, value, error, systematic in (
                ("xhat", self.xhat_term, self.xhat_term_error, self.systematic_xhat_term),
                ("mean", self.mean_term, self.mean_term_error, self.systematic_mean_term),
            )
            if systematic
        ]
        if self.systematic_constant:
            beyond = self.constant_beyond
            parts.append(
                f"{'' if parts else 'its '}mean error on each row beyond that row's rounding of"
                f" it: {self.constant_score:.2g} of its bound in rms over {self.constant_rows:,}"
                f" rows (a correct kernel's within {CONSTANT_LIMIT:g}), {beyond:,}"
                f" row{'' if beyond == 1 else 's'} beyond it (the worst"
                f" {self.constant_worst:.2g} times)"
            )
        verdict = "systematic, not rounding" if self.systematic_term else (
            "not a correct kernel's rounding"
        )  # fmt: skip
        if not self.systematic_term:  # rows judged one by one: not every one is said wrong
            rows = rows.removeprefix("all ")
        return f"{rows}: grad_x's {' and '.join(parts).removeprefix('its ')}: {verdict}"


def pooled_terms(sums: TermSums, gate: float) -> TermFinding | None:
    """The pooled term coefficients of ``sums`` and whether they are systematic (None: no row
    determines them). ``gate`` is what a correct kernel's pooled coefficient may be biased by
    (:func:`term_gate`)."""
    if sums.rows < 1 or not all(pool.w > 0 for pool in sums.pools.values()):
        return None
    found: dict[str, tuple[float, float, bool]] = {}
    for name, pool in sums.pools.items():
        value, error, spread = pool.mean(), pool.error(), pool.spread()
        # Rows weigh as they determine the coefficient; where a few outweigh the rest (a row
        # of var near eps among rows of var far below it), those few are the evidence, and
        # their spread gives no credible standard error either.
        few = len(sums.spreads) < FEW_ROWS or pool.effective_rows() < FEW_ROWS
        if few:  # no credible standard error: the rows' modelled noise instead
            threshold = max(gate, FEW_ROWS_TERM, spread / AGREEMENT, pool.noise())
        else:
            threshold = max(SYSTEMATIC_Z * error, gate, spread / AGREEMENT)
        found[name] = (value, error, abs(value) > threshold)
    (a, a_error, a_systematic), (b, b_error, b_systematic) = found["xhat"], found["mean"]
    finding = TermFinding(
        sums.rows, a, a_error, b, b_error, a_systematic, b_systematic, gate
    )  # fmt: skip
    if sums.constant_rows:
        finding.constant_rows, finding.constant_beyond = sums.constant_rows, sums.constant_beyond
        finding.constant_score = math.sqrt(sums.constant_squares / sums.constant_rows)
        finding.constant_worst = sums.constant_worst
        finding.systematic_constant = (
            len(sums.spreads) >= FEW_ROWS and finding.constant_score > CONSTANT_LIMIT
        )
    for name, other in (("xhat", "mean"), ("mean", "xhat")):
        value, _, systematic = found[name]
        if (
            systematic
            and abs(value - 1) <= MODEL_AGREEMENT
            and abs(found[other][0]) <= (MODEL_AGREEMENT)
        ):
            finding.model = MISSING[name]
    return finding


def term_gate(precision: Precision, channels: int, second_order: float) -> float:
    """What a correct kernel's pooled term coefficient may be biased by (see
    :data:`TERM_ULPS`), its stored rounding (twice: in the half dtypes, their stored output's
    rounding is as much systematic as not on rows of few channels), plus the rows'
    second-order rounding.

    Example:
        >>> from maskln_cli.verify.budget import Precision
        >>> round(term_gate(Precision.of(torch.float32), 64, 0.0) / 2**-24)
        64
    """
    rounding = TERM_ULPS * precision.reduce * max(1.0, math.sqrt(channels) / 8)
    return max(rounding, 2 * precision.store) + 2 * second_order
