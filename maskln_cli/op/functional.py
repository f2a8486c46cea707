"""The op as a purely functional composite of differentiable torch ops.

No ``out=``, nothing in place, no data-dependent Python branching and no ``.item()``: every
torch transform sees through it. The op's kernels (native or raw-op) compute every first
derivative, under torch.func too; this composite's backward formula, :func:`gradients`, is
what second derivatives differentiate (:mod:`maskln_cli.op.autograd`), and the raw-op kernels
redo with it the rare rows whose arithmetic overflows. :func:`masked_layer_norm_functional`,
the forward, is a float64 oracle for the kernels in tests.

Both norms (:mod:`maskln_cli.op.norms`): RMSNorm's rows are LayerNorm's without centering
(``xc = xs``, the mean 0), and its affine is ``xhat * (offset + scale)`` without a bias.

The arithmetic, row by row, in float64 (Ba et al., 2016, with a corrected two-pass variance)::

    xs    = x * 2**-e1                  # e1: the row's binary exponent, so |xs| <= 1
    mean  = mean_C(xs)
    xc    = xs - mean - mean_C(xs - mean)   # the mean's rounding error removed (Chan et al.)
    d     = xc * 2**-e2                 # e2: the deviations' exponent, so |d| <= 1
    rs    = 1 / sqrt(mean_C(d * d) + eps * 4**-(e1 + e2))
    xhat  = d * rs,     rstd = rs * 2**-(e1 + e2)

Scaling by powers of two rounds nothing. The first keeps the sum and the mean of rows near the
float64 limit finite, the second keeps the variance of every row well inside float64's range:
its squares neither overflow (rows from 1e154 up) nor underflow (tiny deviations), so rs is
finite and at most 4 sqrt(C), and so are its derivatives of any order. e2 never scales the
deviations below sqrt(eps)'s exponent: a constant row (deviations 0) gets rs = 1 / sqrt of
about eps's mantissa, and rstd = 1 / sqrt(eps), as the formula says.
"""

from __future__ import annotations

import math

import torch

from maskln_cli.op.norms import LAYER, Norm

__all__ = [
    "gradients",
    "ldexp_exact",
    "masked_layer_norm_functional",
    "masked_norm_functional",
    "normalized_rows",
    "row_means",
    "with_statistics",
]

_EXPONENT_LIMIT = 960
"""Scalings stay within 2**+-960, so that the factors themselves are finite float64 numbers."""


def _row_exponent(magnitude: torch.Tensor) -> torch.Tensor:
    """A binary exponent e of each (detached, non-negative) magnitude, with magnitude * 2**-e
    at most 1 (and at least 1/4); -inf for 0, and 0 for NaN or inf (those rows come out NaN
    anyway). From log2 rather than frexp, which torch.compile's CPU code cannot convert."""
    exponent = torch.floor(torch.log2(magnitude)) + 1
    exponent = torch.where(magnitude > 0, exponent, -math.inf)
    return torch.where(magnitude.isfinite(), exponent, 0.0)


def ldexp_exact(t: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """``t * 2**exponent`` for exponents up to 4 * 960 in magnitude, exactly where the result
    is a normal number: in four steps, each factor finite (torch.ldexp multiplies by
    ``2**exponent``, which is inf from 2**1024). The steps go monotonically from t to the
    result, so none overflows or underflows where the result does not."""
    quarter = torch.trunc(exponent / 4)
    for _ in range(3):
        t = torch.ldexp(t, quarter)
    return torch.ldexp(t, exponent - 3 * quarter)


def _magnitude_exponent(x: torch.Tensor) -> torch.Tensor:
    magnitude = x.detach().abs().amax(dim=-1, keepdim=True)
    return _row_exponent(magnitude).clamp(-_EXPONENT_LIMIT, _EXPONENT_LIMIT)


def row_means(x: torch.Tensor) -> torch.Tensor:
    """The mean of each row of float64 ``x`` ``[..., C]``, ``[..., 1]``, finite for every row of
    finite values (the sum of rows near float64's limit would overflow).

    Example:
        >>> row_means(torch.tensor([[1.7e308, 1.7e308, 1.5e308]], dtype=torch.float64))
        tensor([[1.6333e+308]], dtype=torch.float64)
    """
    e1 = _magnitude_exponent(x)
    return torch.ldexp(torch.ldexp(x, -e1).mean(dim=-1, keepdim=True), e1)


def normalized_rows(
    x: torch.Tensor, valid: torch.Tensor, eps: float, centered: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(xhat, rs, e)`` in float64: the normalized rows, and per row a scaled rstd and its
    exponent, ``rstd = rs * 2**-e`` (see the module docstring); RMSNorm's without
    ``centered``.

    ``xhat`` is 0 on invalid rows, whatever they hold. Differentiable, to any order, in x.

    Example:
        >>> xhat, rs, e = normalized_rows(torch.tensor([[1.0, 3.0], [9.0, 9.0]]),
        ...                               torch.tensor([True, False]), 3.0)
        >>> xhat, torch.ldexp(rs, -e)
        (tensor([[-0.5000,  0.5000],
                [ 0.0000,  0.0000]], dtype=torch.float64), tensor([[0.5000],
                [0.5774]], dtype=torch.float64))
    """
    x = torch.where(valid.unsqueeze(-1), x.double(), 0.0)  # NaN * 0 would still be NaN
    if x.shape[-1] == 0:  # nothing to normalize; amax needs an element
        rs = torch.full_like(x[..., :1], eps).rsqrt()
        return x, rs, torch.zeros_like(rs)
    e1 = _magnitude_exponent(x)
    xs = torch.ldexp(x, -e1)
    xc = xs
    if centered:
        deviations = xs - xs.mean(dim=-1, keepdim=True)
        xc = deviations - deviations.mean(dim=-1, keepdim=True)
    deviation = xc.detach().abs().amax(dim=-1, keepdim=True)
    # Deviations are scaled to below 1, but never below the exponent of sqrt(eps), at which
    # eps itself would dominate: then eps * 4**-(e1 + e2) is about 1, never inf or 0.
    eps_exponent = math.ceil(math.frexp(eps)[1] / 2)
    e2 = torch.maximum(_row_exponent(deviation), eps_exponent - e1)
    e2 = e2.clamp(-_EXPONENT_LIMIT, _EXPONENT_LIMIT)
    d = torch.ldexp(xc, -e2)
    exponent = e1 + e2
    scaled_eps = ldexp_exact(torch.full_like(deviation, eps), -2 * exponent)
    # Positive by construction (var >= max(d**2) / C, or eps term about 1); the clamp only
    # guards eps and magnitudes both at float64's limits.
    tiny = torch.finfo(torch.float64).tiny
    rs = (d.square().mean(dim=-1, keepdim=True) + scaled_eps).clamp_min(tiny).rsqrt()
    return d * rs, rs, exponent


def masked_layer_norm_functional(
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The op, composite: ``xhat * scale + bias`` on valid rows, ``+0.0`` on invalid ones.

    Inputs must be checked and of one compute dtype (float32 or float64): the result has it,
    computed in float64. scale and bias may be batched (broadcastable to x), as under
    ``torch.func.vmap``.

    Example:
        >>> x, valid = torch.tensor([[1.0, 3.0], [9.0, -9.0]]), torch.tensor([True, False])
        >>> masked_layer_norm_functional(x, valid, torch.tensor([2.0, -1.0]),
        ...                              torch.tensor([0.5, 1.0]), 3.0)
        tensor([[-0.5000,  0.5000],
                [ 0.0000,  0.0000]])
    """
    return masked_norm_functional(LAYER, x, valid, scale, bias, eps, 0.0)


def masked_norm_functional(
    norm: Norm,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    offset: float,
) -> torch.Tensor:
    """Either norm, composite: LayerNorm's ``xhat * scale + bias`` or RMSNorm's ``xhat *
    (offset + scale)`` (bias None) on valid rows, ``+0.0`` on invalid ones, as
    :func:`masked_layer_norm_functional`.

    Example:
        >>> from maskln_cli.op.norms import RMS
        >>> masked_norm_functional(RMS, torch.tensor([[3.0, 4.0], [9.0, -9.0]]),
        ...                        torch.tensor([True, False]), torch.tensor([0.0, 1.0]), None,
        ...                        3.5, 1.0)
        tensor([[0.7500, 2.0000],
                [0.0000, 0.0000]])
    """
    xhat, _, _ = normalized_rows(x, valid, eps, norm.centered)
    if bias is not None:
        affine = xhat * scale.double() + bias.double()
    else:
        affine = xhat * (offset + scale.double())
    y = torch.where(valid.unsqueeze(-1), affine, 0.0)
    # In x's layout, as the eager op's output (reductions along the way made y contiguous): a
    # binary op's result takes its first operand's layout. Out of place, for vmap's sake.
    return torch.zeros_like(x) + y.to(x.dtype)


def with_statistics(
    norm: Norm,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    offset: float,
    statistics_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(y, mean, rstd)`` as the kernels return them, composite: y as
    :func:`masked_norm_functional` (differentiable), mean and rstd ``[..., 1]`` in
    ``statistics_dtype``, 0 on invalid rows, detached (the op's are not differentiable); mean
    None for RMSNorm.

    Example:
        >>> y, mean, rstd = with_statistics(
        ...     LAYER, torch.tensor([[1.0, 3.0], [9.0, -9.0]]), torch.tensor([True, False]),
        ...     torch.ones(2), torch.zeros(2), 3.0, 0.0, torch.float32)
        >>> mean.flatten().tolist(), rstd.flatten().tolist()
        ([2.0, 0.0], [0.5, 0.0])
    """
    y = masked_norm_functional(norm, x, valid, scale, bias, eps, offset)
    with torch.no_grad():
        keep = valid.unsqueeze(-1)
        clean = torch.where(keep, x.double(), 0.0)
        _, rs, exponent = normalized_rows(clean, valid, eps, norm.centered)
        mean = None
        if norm.centered:
            mean = torch.where(keep, row_means(clean), 0.0) if x.shape[-1] else torch.zeros_like(rs)
            mean = mean.to(statistics_dtype)
        rstd = torch.where(keep, ldexp_exact(rs, -exponent), 0.0)
    return y, mean, rstd.to(statistics_dtype)


def gradients(
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    needs: tuple[bool, bool, bool] = (True, True, True),
    norm: Norm = LAYER,
    offset: float = 0.0,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dscale, dbias)`` of ``sum(y * dy)``, analytic, from statistics recomputed from x::

        dbias  = sum over valid rows of dy
        dscale = sum over valid rows of dy * xhat
        dx     = rstd * (wdy - xhat * c1 - c2),   wdy = dy * scale,
                 c1 = mean_C(xhat * wdy),  c2 = mean_C(wdy)

    and dx = 0 on invalid rows; RMSNorm's with ``norm``: no dbias, c2 = 0, and wdy = dy *
    (offset + scale). Differentiable in every argument, so autograd can take it again for
    second-order gradients. ``needs`` says which of the three to compute; they are computed in
    float64 and returned in the dtype of dy, x and scale.

    Example:
        >>> gradients(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 3.0]]), torch.tensor([True]),
        ...           torch.ones(2), 3.0)
        (tensor([[ 0.1875, -0.1875]]), tensor([-0.5000,  0.0000]), tensor([1., 0.]))
    """
    need_dx, need_dscale, need_dbias = needs
    keep = valid.unsqueeze(-1)
    dtype = dy.dtype
    dy = torch.where(keep, dy.double(), 0.0)  # outputs of invalid rows are constants
    xhat, rs, exponent = normalized_rows(x, valid, eps, norm.centered)
    dbias = _sum_over_rows(dy).to(dtype) if need_dbias and norm.centered else None
    dscale = _sum_over_rows(dy * xhat).to(dtype) if need_dscale else None
    dx = None
    if need_dx:
        wdy = dy * scale.double() if norm.centered else dy * (offset + scale.double())
        c1 = (xhat * wdy).mean(dim=-1, keepdim=True)
        difference = wdy - xhat * c1
        if norm.centered:
            difference = difference - wdy.mean(dim=-1, keepdim=True)  # c2
        # rstd = rs * 2**-e: scaled last, so that tiny results round once.
        dx = torch.where(keep, ldexp_exact(difference * rs, -exponent), 0.0)
        dx = dx.to(dtype)
    return dx, dscale, dbias


def _sum_over_rows(t: torch.Tensor) -> torch.Tensor:
    # sum(dim=()) would sum everything: a single row [C] is its own sum.
    return t.sum(dim=tuple(range(t.dim() - 1))) if t.dim() > 1 else t
