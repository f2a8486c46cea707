"""Systematic error: the structure rounding does not have, found where magnitude cannot tell.

A correct kernel's rounding is noise: row by row its error has no preferred sign, and averaged
over a million elements it vanishes. A formula or eps mistake is systematic: every row's
normalized values scaled by a factor of the same sign (a wrong eps, a wrong variance, an output
scaled by 1 + 1e-5), or shifted. At wide rows the budget (which grows with sqrt(C)) can hide
such a mistake; its structure cannot hide.

Each valid row's error ``e = RESULT - truth`` is regressed on ``z = xhat * scale`` and on 1:
``e ~ f_r * z + g_r``. The factors ``f_r`` (and shifts ``g_r``) are pooled over rows, weighted
by how well each row determines them, and compared with their standard error, estimated from
their spread over rows (rows are independent, whatever the rounding inside a row): a mistake
stands out by orders of magnitude, rounding by a few standard errors at most. A pooled factor is
called systematic only when the rows also agree on it (their spread is a small share of it:
:data:`AGREEMENT`) and it is larger than what a correct kernel may err systematically
(:func:`systematic_gate`: a few units of the rounding and the second-order rounding of the rows'
statistics), so that the biases of a correct kernel's rounding never fail it.

From the factors, the eps RESULT used is solved for: ``1 + f_r = sqrt((var + eps) / (var +
eps'))`` gives ``eps' = (var + eps) / (1 + f_r)**2 - var`` on each row; when the rows agree, RESULT
matches that eps.

The sums are accumulated block by block (:meth:`FitSums.add`), in a fixed order, in float64.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from maskln_cli.verify.budget import Precision

SYSTEMATIC_Z = 8.0
"""A pooled coefficient is systematic beyond this many standard errors (and its gate)."""
AGREEMENT = 0.25
"""Rows agree on a factor (or shift) when their spread is below this share of it. A mistake
gives every row about the same factor; a rounding bias, such as a float32 sequential sum's
of 65,536 squares (which loses about 7e-6 of the variance), comes with a spread from row to
row as large as half of it."""
SYSTEMATIC_ULPS = 16.0
"""What a correct kernel may err systematically, in units of its reductions' rounding: a
biased square root or division errs by a fraction of an ulp on every row."""
MIN_ROWS = 8
"""Fewer rows give no credible standard error: nothing is called systematic."""
ALWAYS_REPORT = False
"""Report the pooled regressions of every tensor, systematic or not (read when a tensor is
explained; benchmarks/verify_calibration.py turns it on, to show how far from systematic the
correct kernels stay)."""
KEPT_ROWS = 1 << 16
"""Rows whose factors are kept to solve for eps on."""


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
    # Each row's (f_r, var + eps, weight), for the first KEPT_ROWS usable rows: eps is
    # solved for on them.
    kept: list[torch.Tensor] = field(default_factory=list)
    kept_rows: int = 0

    def add(self, other: FitSums) -> None:
        for item in fields(self):
            if item.name not in ("kept", "kept_rows"):
                setattr(self, item.name, getattr(self, item.name) + getattr(other, item.name))
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
) -> FitSums:
    """The sums of rows ``[R, C]`` (float64): ``error`` is RESULT - truth, ``z`` the truth's
    ``xhat * scale``, ``rstd`` ``[R]`` the truth's 1 / sqrt(var + eps), ``second_order``
    ``[R]`` each row's modelled second-order rounding (budget's e2), ``rows`` ``[R]`` the rows
    to fit (None: all; rows whose sums are not finite are left out).

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
    sz, szz = z.sum(dim=1), z.square().sum(dim=1)
    se, sze = error.sum(dim=1), (z * error).sum(dim=1)
    det = szz * channels - sz.square()
    usable = (det > 1e-12 * szz * channels) & det.isfinite() & se.isfinite() & sze.isfinite()
    usable &= second_order.isfinite()
    if rows is not None:
        usable &= rows
    if not bool(usable.any()):
        return sums
    sz, szz, se, sze, det = (t[usable] for t in (sz, szz, se, sze, det))
    f = (sze * channels - sz * se) / det
    g = (szz * se - sz * sze) / det
    w = det / channels  # sum of (z - mean z)**2: how well the row determines f
    v = det / szz  # C - (sum z)**2 / sum z**2: how well it determines g
    sums.rows = int(usable.sum())
    sums.w, sums.wf, sums.wff = (float((w * f**k).sum()) for k in (0, 1, 2))
    sums.w2, sums.w2f, sums.w2ff = (float((w.square() * f**k).sum()) for k in (0, 1, 2))
    sums.v, sums.vg, sums.vgg = (float((v * g**k).sum()) for k in (0, 1, 2))
    sums.v2, sums.v2g, sums.v2gg = (float((v.square() * g**k).sum()) for k in (0, 1, 2))
    sums.we2 = float((w * second_order[usable]).sum())
    spread = rstd[usable].square().reciprocal()  # var + eps
    sums.kept = [torch.stack([f, spread, w], dim=1)]
    sums.kept_rows = len(f)
    return sums


@dataclass
class Finding:
    """What the pooled regressions say: the factor and shift with their standard errors,
    whether either is systematic, and the eps RESULT matches (None: none found)."""

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

    @property
    def systematic(self) -> bool:
        return self.systematic_factor or self.systematic_shift

    def to_dict(self) -> dict[str, object]:
        return asdict(self)  # every field, in order

    def sentence(self, eps: float, eps_origin: str) -> str:
        """``all 922 valid rows scaled by 1 - 4.5e-06 ± 2e-09: systematic; RESULT matches
        eps ≈ 1e-06 ...``"""
        parts = []
        if self.systematic_factor:
            sign = "+" if self.factor >= 0 else "-"
            parts.append(
                f"all {self.rows:,} valid rows scaled by 1 {sign} {abs(self.factor):.2g}"
                f" ± {self.factor_error:.1g}"
            )
        if self.systematic_shift:
            parts.append(
                f"{'and ' if parts else f'all {self.rows:,} valid rows '}shifted by"
                f" {self.shift:+.2g} ± {self.shift_error:.1g}"
            )
        text = " ".join(parts) + ": systematic, not rounding"
        found = None
        if self.eps is not None:
            found, given = f"eps ≈ {self.eps:.2g}", f"{self.eps:.2g}"
        elif self.eps_at_most is not None:
            found, given = f"an eps of at most {self.eps_at_most:.1g}", "EPS"
        if found is not None:
            text += f"; RESULT matches {found} on all {self.rows:,} valid rows; the reference"
            if eps_origin == "the default":  # probably forgotten: say how to give it
                text += f" used {eps:g} (the default): give `--eps {given}` or `--config`"
            else:  # given (a dump's metadata, a config): more likely the kernel's is wrong
                text += (
                    f" used {eps:g} ({eps_origin}): the kernel's eps is not the model's (if"
                    f" RESULT's is the right one, give `--eps {given}`)"
                )
        return text


def systematic_gate(precision: Precision, second_order: float, bias_to_scale: float) -> float:
    """How large a pooled relative factor a correct kernel in ``precision`` may show: a few
    units of its reductions' rounding; the rounding of its stored output, which on rows of
    nearly equal values (C of 2 to 16, in a half dtype) is as much systematic as not, by up to
    an ulp of the output, bias included (``bias_to_scale``: rms(bias) / rms(scale)); plus the
    rows' second-order rounding (a row mean off by d inflates the variance by d**2).

    Example:
        >>> import torch
        >>> from maskln_cli.verify.budget import Precision
        >>> round(systematic_gate(Precision.of(torch.float32), 0.0, 1.0) / 2**-24)
        16
    """
    stored = 2 * precision.store * (1 + bias_to_scale)
    return max(SYSTEMATIC_ULPS * precision.reduce, stored) + second_order


def pooled(
    sums: FitSums, precision: Precision, eps: float, scale_size: float, bias_size: float
) -> Finding | None:
    """The pooled factor and shift and whether they are systematic (None: too few rows).
    ``scale_size`` and ``bias_size`` are the rms of scale and bias: a shift is measured
    against the output's values, ``scale_size + bias_size``."""
    if sums.rows < MIN_ROWS or sums.w <= 0 or sums.v <= 0:
        return None
    factor = sums.wf / sums.w
    factor_error = (
        math.sqrt(max(0.0, sums.w2ff - 2 * factor * sums.w2f + factor**2 * sums.w2)) / sums.w
    )
    shift = sums.vg / sums.v
    shift_error = (
        math.sqrt(max(0.0, sums.v2gg - 2 * shift * sums.v2g + shift**2 * sums.v2)) / sums.v
    )
    ratio = bias_size / scale_size if scale_size > 0 else math.inf
    gate = systematic_gate(precision, sums.we2 / sums.w, ratio)
    factor_spread = math.sqrt(max(0.0, sums.wff / sums.w - factor**2))
    shift_spread = math.sqrt(max(0.0, sums.vgg / sums.v - shift**2))
    threshold = max(SYSTEMATIC_Z * factor_error, gate, factor_spread / AGREEMENT)
    systematic_factor = abs(factor) > threshold
    shift_gate = gate * (scale_size + bias_size)
    systematic_shift = abs(shift) > max(
        SYSTEMATIC_Z * shift_error, shift_gate, shift_spread / AGREEMENT
    )
    finding = Finding(
        sums.rows, factor, factor_error, shift, shift_error, gate, systematic_factor,
        systematic_shift, score=abs(factor) / threshold,
    )  # fmt: skip
    if systematic_factor and not systematic_shift and sums.kept:
        finding.eps, finding.eps_at_most = solve_eps(torch.cat(sums.kept), eps)
    return finding


def solve_eps(kept: torch.Tensor, eps: float) -> tuple[float | None, float | None]:
    """The eps RESULT used, from rows' ``(f_r, var + eps, weight)``: ``(eps', None)``, or
    ``(None, bound)`` when it is too small to resolve (RESULT's eps is at most ``bound``, less
    than ``eps``), or
    ``(None, None)`` when an eps explains the rows' factors no better than one common factor
    (an output scaled, not an eps).

    Each row gives ``eps' = S / (1 + f_r)**2 - (S - eps)`` (S = var + eps), with an error
    of about ``2 * S`` times f_r's: they are pooled with weights ``1 / S**2``.

    Example:
        >>> import torch
        >>> var = torch.tensor([0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0], dtype=torch.float64)
        >>> f = ((var + 1e-5) / (var + 1e-3)).sqrt() - 1  # RESULT used eps 1e-3
        >>> kept = torch.stack([f, var + 1e-5, torch.ones(8, dtype=torch.float64)], dim=1)
        >>> found, _ = solve_eps(kept, 1e-5)
        >>> round(found, 9)
        0.001
    """
    f, spread, w = kept.unbind(dim=1)
    estimate = spread * (1 + f).square().reciprocal() - (spread - eps)
    q = spread.square().reciprocal()
    total = float(q.sum())
    if not total > 0 or len(f) < MIN_ROWS:
        return None, None
    found = float((q * estimate).sum()) / total
    error = float(((q * (estimate - found)).square().sum()).sqrt()) / total
    # The eps model against one common factor: which explains the rows' factors better?
    predicted = (spread / (spread - eps + max(found, 0.0))).sqrt() - 1
    common = float((w * f).sum() / w.sum())
    by_eps = float((w * (f - predicted).square()).sum())
    by_factor = float((w * (f - common).square()).sum())
    if by_eps > by_factor * 1.01 + 1e-300:
        return None, None
    if found > 3 * error:
        return found, None
    if 0 < found + 3 * error < eps:  # a smaller eps than the reference's, too small to resolve
        return None, found + 3 * error
    return None, None
