"""vmap's rules for the op and its backward, either norm: the batch axis becomes one more leading
axis of x, so that one call computes the whole batch.

The rules serve both the Functions of :mod:`maskln_cli.op.autograd` (their ``vmap``
staticmethods) and the registered ops (:mod:`maskln_cli.op.library`), each passing how it
computes one call, in the op's inner calling convention (:mod:`maskln_cli.op.norms`):
``forward(x, valid, scale, bias, eps, offset) -> (y, mean, rstd)`` and ``backward(dy, x, valid,
scale, mean, rstd, eps, offset, needs) -> (dx, dscale, dbias)``, bias, mean and dbias None for
RMSNorm. The batch dimensions are given in that order too (None for an argument not batched,
or absent).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from maskln_cli.op.checks import compute_dtype
from maskln_cli.op.norms import Norm

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
Statistics = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
Forward = Callable[..., Statistics]
Backward = Callable[..., Grads]


def batch_first(tensor: torch.Tensor, dim: int | None, size: int) -> torch.Tensor:
    """``tensor`` with its batch axis first, expanded to ``size`` when it has none."""
    if dim is None:
        return tensor.unsqueeze(0).expand(size, *tensor.shape)
    return tensor.movedim(dim, 0)


def normalized(
    norm: Norm, x: torch.Tensor, valid: torch.Tensor, eps: float, forward: Forward
) -> torch.Tensor:
    """xhat (unit scale, zero bias or offset) in the compute dtype, by ``forward``."""
    compute = compute_dtype(x.dtype)
    unit = torch.ones(x.shape[-1], dtype=compute, device=x.device)
    zero = torch.zeros_like(unit) if norm.centered else None
    return forward(x.to(compute), valid, unit, zero, eps, 0.0)[0]


def batched_forward(
    norm: Norm,
    size: int,
    dims: tuple[int | None, int | None, int | None, int | None],
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    offset: float,
    *,
    forward: Forward,
) -> Statistics:
    """``(y, mean, rstd)`` of a batch, its batch axis first; ``dims`` those of x, valid, scale
    and bias. Batched scale and bias apply to the normalized rows, computed with unit
    parameters."""
    x = batch_first(x, dims[0], size)
    valid = batch_first(valid, dims[1], size)
    if dims[2] is None and dims[3] is None:
        return forward(x, valid, scale, bias, eps, offset)
    compute = compute_dtype(x.dtype)
    unit = torch.ones(x.shape[-1], dtype=compute, device=x.device)
    zero = torch.zeros_like(unit) if norm.centered else None
    xhat, mean, rstd = forward(x.to(compute), valid, unit, zero, eps, 0.0)
    view = (size,) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    scale = batch_first(scale, dims[2], size).reshape(view)
    if bias is not None:
        y = xhat * scale + batch_first(bias, dims[3], size).reshape(view)
    else:
        y = xhat * (offset + scale)
    y = y.masked_fill(~valid.unsqueeze(-1), 0.0)
    return y.to(x.dtype), mean, rstd


def batched_backward(
    norm: Norm,
    size: int,
    dims: tuple[int | None, ...],
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    eps: float,
    offset: float,
    needs: tuple[bool, bool, bool],
    *,
    forward: Forward,
    backward: Backward,
) -> Grads:
    """``(dx, dscale, dbias)`` of a batch, each with its batch axis first (None where not
    needed); ``dims`` those of dy, x, valid, scale, mean and rstd. dx from one backward call
    over the whole batch (a batched scale multiplies dy first, with the offset, and the call
    takes unit scale); dscale and dbias summed per batch element over its own rows (xhat by
    ``forward``)."""
    dy, x, valid, rstd = (
        batch_first(t, d, size)
        for t, d in zip((dy, x, valid, rstd), (*dims[:3], dims[5]), strict=True)
    )
    if mean is not None:
        mean = batch_first(mean, dims[4], size)
    need_dx, need_dscale, need_dbias = needs
    dx = dscale = dbias = None
    if need_dx:
        wdy, weight, gain_offset = dy, scale, offset
        if dims[3] is not None:
            view = (size,) + (1,) * (x.dim() - 2) + (x.shape[-1],)
            batched_scale = batch_first(scale, dims[3], size).reshape(view)
            if norm.centered:
                wdy = (dy * batched_scale).to(dy.dtype)
            else:
                wdy = (dy * (offset + batched_scale)).to(dy.dtype)
            weight = torch.ones(x.shape[-1], dtype=scale.dtype, device=x.device)
            gain_offset = 0.0
        single = (True, False, False)
        dx = backward(wdy, x, valid, weight, mean, rstd, eps, gain_offset, single)[0]
    if need_dscale or need_dbias:
        kept = dy.masked_fill(~valid.unsqueeze(-1), 0.0)  # invalid rows count for nothing
        rows = tuple(range(1, dy.dim() - 1))

        def per_element(t: torch.Tensor) -> torch.Tensor:
            total = t.sum(dim=rows, dtype=torch.float64) if rows else t.double()
            return total.to(scale.dtype)

        if need_dscale:
            dscale = per_element(kept * normalized(norm, x, valid, eps, forward))
        if need_dbias and norm.centered:
            dbias = per_element(kept)
    return dx, dscale, dbias
