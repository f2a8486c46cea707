"""Which model explains rows' factors (:func:`explain_factors`): one common factor (an
output scaled); another eps, ``1 + f_r = sqrt((var + eps) / (var + eps'))``, eps' solved for;
or a normalization mistake of the catalogue, a function of the row's variance with nothing to
fit (:data:`MISTAKE_FACTORS`). Rows of different variance tell them apart; a mistake named
with nothing fitted is preferred when it explains the rows as well as the fitted models do.
The systematic-error test (:mod:`maskln_cli.verify.systematic`) asks, once a factor is beyond
its thresholds."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

NAMED_PREFERENCE = 1.25
"""A named mistake (nothing fitted) is preferred to a fitted model that explains the rows'
factors at most this many times better: a fitted parameter can always follow some noise."""

Factor = Callable[[torch.Tensor, float, int], torch.Tensor]
"""A row's factor ``k - 1`` from its ``S = var + eps`` (float64), eps and C."""

MISTAKE_FACTORS: dict[str, Factor] = {
    "eps_outside_sqrt": lambda s, eps, c: s.sqrt() / ((s - eps).clamp_min(0).sqrt() + eps) - 1,
    "unbiased_variance": lambda s, eps, c: (s / ((s - eps) * (c / max(c - 1, 1)) + eps)).sqrt() - 1,
    "sqrt_missing": lambda s, eps, c: s.rsqrt() - 1,
}
"""The catalogue's normalization mistakes (:data:`maskln_cli.op.mistakes.MISTAKES`) as the
factor each gives a row of variance ``var`` (nothing to fit): ``xhat' / xhat - 1``."""


def explain_factors(
    kept: torch.Tensor, eps: float, channels: int
) -> tuple[str, float | None, float | None, float]:
    """Which model explains rows' factors, from their ``(f_r, var + eps, weight[, noise])``:
    ``(model, eps', eps_at_most, left)``. ``model`` is ``factor`` (one common factor), ``eps``
    (another eps: ``eps'``, or ``eps_at_most`` when it is too small to resolve and less than
    ``eps``) or a name of :data:`MISTAKE_FACTORS`; ``left`` is the rms of what it leaves
    unexplained. A model leaving more than the rows' noise allows is not one (:func:`_explains`).

    Example:
        >>> import torch
        >>> var = torch.tensor([0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0], dtype=torch.float64)
        >>> s = var + 1e-5
        >>> f = (s / (var + 1e-3)).sqrt() - 1  # RESULT used eps 1e-3
        >>> model, found, _, _ = explain_factors(torch.stack([f, s, torch.ones(8)], 1), 1e-5, 64)
        >>> model, round(found, 9)
        ('eps', 0.001)
        >>> f = s.sqrt() / (var.sqrt() + 1e-5) - 1  # eps outside the square root
        >>> explain_factors(torch.stack([f, s, torch.ones(8)], 1), 1e-5, 64)[0]
        'eps_outside_sqrt'
    """
    f, spread, w = kept.double()[:, :3].unbind(dim=1)
    total = float(w.sum())
    if not total > 0:
        return "factor", None, None, 0.0

    def left_by(predicted: torch.Tensor) -> float:
        return float((w * (f - predicted).square()).sum())

    common = float((w * f).sum()) / total
    by_factor = left_by(torch.full_like(f, common))
    found, error = _solve_eps(f, spread, eps)
    by_eps = math.inf
    if found is not None:
        by_eps = left_by((spread / (spread - eps + max(found, 0.0))).sqrt() - 1)
    best, fitted = ("eps", by_eps) if by_eps <= by_factor * 1.01 + 1e-300 else ("factor", by_factor)
    named = {name: left_by(model(spread, eps, channels)) for name, model in MISTAKE_FACTORS.items()}
    name = min(named, key=named.__getitem__)
    if named[name] <= fitted * NAMED_PREFERENCE + 1e-300:
        best, fitted = name, named[name]
    left = math.sqrt(fitted / total)
    noise = kept[:, 3].double() if kept.shape[1] > 3 else torch.zeros_like(f)
    if best != "factor" and not _explains(left, f, noise, w):
        return "factor", None, None, math.sqrt(by_factor / total)
    if best != "eps":
        return best, None, None, left
    assert found is not None and error is not None
    if found > 3 * error and found <= PLAUSIBLE_EPS * float(spread.max()):
        return "eps", found, None, left
    if 0 < found + 3 * error < eps:  # a smaller eps than the reference's, too small to resolve
        return "eps", None, found + 3 * error, left
    return "factor", None, None, math.sqrt(by_factor / total)


def _explains(left: float, f: torch.Tensor, noise: torch.Tensor, w: torch.Tensor) -> bool:
    """Does a model leaving ``left`` (rms) of the rows' factors ``f`` unexplained explain them:
    within MODEL_NOISE of the rows' modelled noise, or MODEL_SHARE of the factors themselves?"""
    total = float(w.sum())
    noise_rms = math.sqrt(float((w * noise.square()).sum()) / total)
    f_rms = math.sqrt(float((w * f.square()).sum()) / total)
    return left <= max(MODEL_NOISE * noise_rms, MODEL_SHARE * f_rms)


MODEL_NOISE = 2.0
MODEL_SHARE = 0.02
"""A model of the rows' factors (another eps, a mistake of the catalogue) is named only when
what it leaves unexplained is at most twice the rows' modelled noise, or 2% of the factors:
eps both inside and outside the square root on heavy-tailed rows was fitted as 'eps 4.4e-05'
leaving 24 times the noise (10% of the factors), where a true eps leaves 0.8 to 1.1 times it."""

PLAUSIBLE_EPS = 1e3
"""An eps found above this many times the largest row's variance is no eps (a Welford kernel's
variance a million times too large on rows 1e4 + N(0, 0.1) fitted eps 1.6e6): the rows are
said to be scaled alike instead."""


def _solve_eps(
    f: torch.Tensor, spread: torch.Tensor, eps: float
) -> tuple[float | None, float | None]:
    """The eps the rows' factors give, and its error: each row gives ``eps' = S / (1 + f_r)**2
    - (S - eps)`` (S = var + eps), with an error of about ``2 * S`` times f_r's: they are
    pooled with weights ``1 / S**2``."""
    estimate = spread * (1 + f).square().reciprocal() - (spread - eps)
    q = spread.square().reciprocal()
    total = float(q.sum())
    if not total > 0 or len(f) < 2:
        return None, None
    found = float((q * estimate).sum()) / total
    error = float(((q * (estimate - found)).square().sum()).sqrt()) / total
    return found, error
