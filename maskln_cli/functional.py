"""The op as a purely functional composite of differentiable torch ops.

No ``out=``, nothing in place, no data-dependent Python branching and no ``.item()``: every
torch transform sees through it. :mod:`maskln_cli.core` runs it under ``torch.func`` transforms
(grad, vmap, jvp, jacfwd, hessian) and forward-mode AD, and uses its backward formula for
second-order gradients; the fast blocked kernels in core stay the eager default.

The arithmetic is the eager op's, row by row (Ba et al., 2016, with a corrected two-pass
variance)::

    xs    = x * 2**-e                   # e: the row's binary exponent, so |xs| < 1; exact
    mean  = mean_C(xs)
    xc    = xs - mean
    shift = mean_C(xc)                  # mean's rounding error (Chan, Golub & LeVeque)
    var   = mean_C(xc * xc) - shift**2
    rs    = 1 / sqrt(var + eps * 2**-2e)   # rstd of x is rs * 2**-e
    xhat  = (xc - shift) * rs

Scaling each row by a power of two rounds nothing, and keeps the squares of float64 rows from
overflowing (|x| from about 1e154): the row is normalized as exactly as one of ordinary size.
Rows are never scaled up (e >= 0), so eps keeps its meaning for tiny rows.
"""

from __future__ import annotations

import torch

__all__ = ["gradients", "masked_layer_norm_functional", "normalized_rows"]


def row_exponents(x: torch.Tensor) -> torch.Tensor:
    """Per row of ``x`` ``[..., C]``, a binary exponent ``e >= 0`` with ``|x| * 2**-e < 1``
    (0 for rows below 1, of zeros, or holding NaN or inf); shape ``[..., 1]``, x's dtype.

    Not differentiated: it is a constant of each row, so the scaling it gives is linear.

    Example:
        >>> row_exponents(torch.tensor([[3.0, -1.0], [0.25, 0.0], [1e20, 1.0]]))
        tensor([[ 2.],
                [ 0.],
                [67.]])
    """
    if x.shape[-1] == 0:  # amax needs an element
        return x.new_zeros((*x.shape[:-1], 1))
    magnitude = x.detach().abs().amax(dim=-1, keepdim=True)
    exponent = torch.frexp(magnitude).exponent.to(x.dtype)  # magnitude = m * 2**e, m in [0.5, 1)
    return torch.where(magnitude.isfinite(), exponent.clamp_min(0), 0.0)


def normalized_rows(
    x: torch.Tensor, valid: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(xhat, rs, e)``: the normalized rows, and each row's scaled rstd and exponent.

    The rstd of row x is ``rs * 2**-e`` (see the module docstring); ``xhat`` is 0 on invalid
    rows, whatever they hold. Differentiable, to any order, in x.

    Example:
        >>> xhat, rs, e = normalized_rows(torch.tensor([[1.0, 3.0], [9.0, 9.0]]),
        ...                               torch.tensor([True, False]), 3.0)
        >>> xhat, torch.ldexp(rs, -e)
        (tensor([[-0.5000,  0.5000],
                [ 0.0000,  0.0000]]), tensor([[0.5000],
                [0.5774]]))
    """
    keep = valid.unsqueeze(-1)
    x = torch.where(keep, x, 0.0)  # before any arithmetic: NaN * 0 would still be NaN
    exponent = row_exponents(x)
    xs = torch.ldexp(x, -exponent)
    mean = xs.mean(dim=-1, keepdim=True)
    xc = xs - mean
    shift = xc.mean(dim=-1, keepdim=True)
    var = ((xc * xc).mean(dim=-1, keepdim=True) - shift * shift).clamp_min(0.0)
    # eps * 2**-2e underflows to 0 for rows of huge magnitude; the clamp keeps a constant row's
    # rs finite, so that its xhat is 0 * rs = 0 rather than 0 * inf.
    tiny = torch.finfo(x.dtype).tiny
    rs = (var + torch.ldexp(torch.full_like(var, eps), -2 * exponent)).clamp_min(tiny).rsqrt()
    return (xc - shift) * rs, rs, exponent


def masked_layer_norm_functional(
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The op, composite: ``xhat * scale + bias`` on valid rows, ``+0.0`` on invalid ones.

    Inputs must be checked and of one compute dtype (float32 or float64); scale and bias may
    be batched (broadcastable to x), as under ``torch.func.vmap``.

    Example:
        >>> x, valid = torch.tensor([[1.0, 3.0], [9.0, -9.0]]), torch.tensor([True, False])
        >>> masked_layer_norm_functional(x, valid, torch.tensor([2.0, -1.0]),
        ...                              torch.tensor([0.5, 1.0]), 3.0)
        tensor([[-0.5000,  0.5000],
                [ 0.0000,  0.0000]])
    """
    xhat, _, _ = normalized_rows(x, valid, eps)
    return torch.where(valid.unsqueeze(-1), xhat * scale + bias, 0.0)


def gradients(
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    needs: tuple[bool, bool, bool] = (True, True, True),
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dscale, dbias)`` of ``sum(y * dy)``, analytic, from statistics recomputed from x::

        dbias  = sum over valid rows of dy
        dscale = sum over valid rows of dy * xhat
        dx     = rstd * (wdy - xhat * c1 - c2),   wdy = dy * scale,
                 c1 = mean_C(xhat * wdy),  c2 = mean_C(wdy)

    and dx = 0 on invalid rows. Differentiable in every argument, so autograd can take it
    again for second-order gradients. ``needs`` says which of the three to compute.

    Example:
        >>> gradients(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 3.0]]), torch.tensor([True]),
        ...           torch.ones(2), 3.0)
        (tensor([[ 0.1875, -0.1875]]), tensor([-0.5000,  0.0000]), tensor([1., 0.]))
    """
    need_dx, need_dscale, need_dbias = needs
    keep = valid.unsqueeze(-1)
    dy = torch.where(keep, dy, 0.0)  # outputs of invalid rows are constants
    xhat, rs, exponent = normalized_rows(x, valid, eps)
    dbias = _sum_over_rows(dy) if need_dbias else None
    dscale = _sum_over_rows(dy * xhat) if need_dscale else None
    dx = None
    if need_dx:
        wdy = dy * scale
        c1 = (xhat * wdy).mean(dim=-1, keepdim=True)
        c2 = wdy.mean(dim=-1, keepdim=True)
        # rstd = rs * 2**-e: scaled last, so that tiny results round once.
        dx = torch.where(keep, torch.ldexp((wdy - xhat * c1 - c2) * rs, -exponent), 0.0)
    return dx, dscale, dbias


def _sum_over_rows(t: torch.Tensor) -> torch.Tensor:
    # sum(dim=()) would sum everything: a single row [C] is its own sum.
    return t.sum(dim=tuple(range(t.dim() - 1))) if t.dim() > 1 else t
