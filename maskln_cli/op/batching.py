"""vmap's rules for the op and its backward: the batch axis becomes one more leading axis of x,
so that one call computes the whole batch.

The rules serve both the Functions of :mod:`maskln_cli.op.autograd` (their ``vmap``
staticmethods) and the registered ops (:mod:`maskln_cli.op.library`), each passing how it
computes one call: ``forward(x, valid, scale, bias, eps) -> (y, mean, rstd)`` and
``backward(dy, x, valid, scale, mean, rstd, eps, needs) -> (dx, dscale, dbias)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from maskln_cli.op.checks import compute_dtype

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
Statistics = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], Statistics]
Backward = Callable[..., Grads]


def batch_first(tensor: torch.Tensor, dim: int | None, size: int) -> torch.Tensor:
    """``tensor`` with its batch axis first, expanded to ``size`` when it has none."""
    if dim is None:
        return tensor.unsqueeze(0).expand(size, *tensor.shape)
    return tensor.movedim(dim, 0)


def normalized(x: torch.Tensor, valid: torch.Tensor, eps: float, forward: Forward) -> torch.Tensor:
    """xhat (unit scale, zero bias) in the compute dtype, by ``forward``."""
    compute = compute_dtype(x.dtype)
    unit = torch.ones(x.shape[-1], dtype=compute, device=x.device)
    return forward(x.to(compute), valid, unit, torch.zeros_like(unit), eps)[0]


def batched_forward(
    size: int,
    in_dims: tuple[int | None, ...],
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    *,
    forward: Forward,
) -> tuple[Statistics, tuple[int, int, int]]:
    """The forward of a batch: batched scale and bias apply to the normalized rows, computed
    with unit parameters."""
    x = batch_first(x, in_dims[0], size)
    valid = batch_first(valid, in_dims[1], size)
    if in_dims[2] is None and in_dims[3] is None:
        return forward(x, valid, scale, bias, eps), (0, 0, 0)
    compute = compute_dtype(x.dtype)
    unit = torch.ones(x.shape[-1], dtype=compute, device=x.device)
    xhat, mean, rstd = forward(x.to(compute), valid, unit, torch.zeros_like(unit), eps)
    view = (size,) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    scale = batch_first(scale, in_dims[2], size).reshape(view)
    bias = batch_first(bias, in_dims[3], size).reshape(view)
    y = (xhat * scale + bias).masked_fill(~valid.unsqueeze(-1), 0.0)
    return (y.to(x.dtype), mean, rstd), (0, 0, 0)


def batched_backward(
    size: int,
    in_dims: tuple[int | None, ...],
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    needs: tuple[bool, bool, bool],
    *,
    forward: Forward,
    backward: Backward,
) -> tuple[Grads, tuple[int | None, ...]]:
    """The backward of a batch: dx from one backward call over the whole batch (a batched
    scale multiplies dy first, and the call takes unit scale); dscale and dbias summed per
    batch element over its own rows (xhat by ``forward``)."""
    batched = (*in_dims[:3], *in_dims[4:6])
    dy, x, valid, mean, rstd = (
        batch_first(t, d, size) for t, d in zip((dy, x, valid, mean, rstd), batched, strict=True)
    )
    need_dx, need_dscale, need_dbias = needs
    dx = dscale = dbias = None
    if need_dx:
        wdy, weight = dy, scale
        if in_dims[3] is not None:
            view = (size,) + (1,) * (x.dim() - 2) + (x.shape[-1],)
            wdy = (dy * batch_first(scale, in_dims[3], size).reshape(view)).to(dy.dtype)
            weight = torch.ones(x.shape[-1], dtype=scale.dtype, device=x.device)
        dx = backward(wdy, x, valid, weight, mean, rstd, eps, (True, False, False))[0]
    if need_dscale or need_dbias:
        kept = dy.masked_fill(~valid.unsqueeze(-1), 0.0)  # invalid rows count for nothing
        rows = tuple(range(1, dy.dim() - 1))

        def per_element(t: torch.Tensor) -> torch.Tensor:
            total = t.sum(dim=rows, dtype=torch.float64) if rows else t.double()
            return total.to(scale.dtype)

        if need_dscale:
            dscale = per_element(kept * normalized(x, valid, eps, forward))
        if need_dbias:
            dbias = per_element(kept)
    grads = (dx, dscale, dbias)
    return grads, tuple(None if g is None else 0 for g in grads)
