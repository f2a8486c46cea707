"""Masked layer normalization: the op, its checks, and its autograd.

For each valid row x of C channels (Ba et al., 2016), with a two-pass variance::

    mean  = sum(x) / C
    xc    = x - mean
    shift = sum(xc) / C                              # mean's rounding error, ~0
    rstd  = 1 / sqrt(sum(xc * xc) / C - shift**2 + eps)
    xhat  = (xc - shift) * rstd
    y     = xhat * scale + bias

and y = +0.0 on invalid rows. The backward pass, with wdy = scale * dy::

    dbias  = sum over valid rows of dy
    dscale = sum over valid rows of dy * xhat
    dx     = rstd * (wdy - xhat * c1 - c2),   c1 = mean_C(xhat * wdy),  c2 = mean_C(wdy)

and dx = 0 on invalid rows. An invalid row is never mixed with another: its statistics are its
own and are set to 0 before use; NaN or inf in it, flagged by its non-finite mean, are zeroed
before any other arithmetic; and every sum across rows (dscale, dbias) reads valid rows only. So
whatever invalid rows hold never reaches an output or a gradient.

``shift`` is the corrected two-pass algorithm (Chan, Golub & LeVeque, 1983): on float32 rows
with a large common offset it keeps the error near float32's resolution, where a plain two-pass
(torch's own layer_norm included) loses several digits to the rounded mean.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator

import torch

__all__ = ["masked_layer_normalization"]

_COMPUTED_IN_FLOAT32 = (torch.float16, torch.bfloat16)
_SUPPORTED_DTYPES = (torch.float32, torch.float64, *_COMPUTED_IN_FLOAT32)


def masked_layer_normalization(
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-05,
) -> torch.Tensor:
    """Layer-normalize the valid rows of ``x`` over its last axis; zero the invalid rows.

    Args:
        x: ``[..., C]`` floating tensor (float32 or float64; float16 and bfloat16 are
            computed in float32 and returned in their own dtype). Any strides.
        valid: ``[...]`` bool tensor, exactly ``x``'s leading shape. ``False`` rows give
            ``+0.0`` whatever ``x`` holds there, NaN and inf included.
        scale: ``[C]`` tensor of ``x``'s dtype, multiplied after normalization.
        bias: ``[C]`` tensor of ``x``'s dtype, added after scaling.
        eps: finite positive number added to the population variance inside the sqrt.

    Returns:
        A tensor of ``x``'s shape, dtype, device and memory layout (as ``torch.empty_like(x)``).
        It requires grad when ``x``, ``scale`` or ``bias`` does; first and second derivatives
        are supported.

    Raises:
        TypeError, ValueError: the message names the offending argument.

    Example:
        >>> x = torch.tensor([[[1.0, 3.0], [99.0, -99.0]]], dtype=torch.float64)
        >>> valid = torch.tensor([[True, False]])
        >>> scale = torch.tensor([2.0, -1.0], dtype=torch.float64)
        >>> bias = torch.tensor([0.5, 1.0], dtype=torch.float64)
        >>> masked_layer_normalization(x, valid, scale, bias, eps=3.0)
        tensor([[[-0.5000,  0.5000],
                 [ 0.0000,  0.0000]]], dtype=torch.float64)
    """
    eps = check_inputs(x, valid, scale, bias, eps)
    dtype = x.dtype
    if dtype in _COMPUTED_IN_FLOAT32:  # differentiable casts: gradients come back in dtype
        x, scale, bias = x.float(), scale.float(), bias.float()
    if torch.is_grad_enabled() and (x.requires_grad or scale.requires_grad or bias.requires_grad):
        out = _MaskedLayerNorm.apply(x, valid, scale, bias, eps)
    else:
        out = forward(x, valid, scale, bias, eps, keep_statistics=False)[0]
    return out.to(dtype)


def check_inputs(x: object, valid: object, scale: object, bias: object, eps: object) -> float:
    """Raise TypeError or ValueError naming the offending argument; return eps as a float.

    Example:
        >>> check_inputs(torch.zeros(2, 3), torch.ones(2, dtype=torch.bool),
        ...              torch.ones(3), torch.zeros(3), 1e-5)
        1e-05
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"x must be a float32, float64, float16 or bfloat16 tensor, got {_dtype_name(x.dtype)}"
        )
    if x.dim() == 0:
        raise ValueError("x must have a channel axis (shape [..., C]), got a 0-d tensor")
    if not isinstance(valid, torch.Tensor):
        raise TypeError(f"valid must be a bool torch.Tensor, got {type(valid).__name__}")
    if valid.dtype != torch.bool:
        raise TypeError(f"valid must be a bool tensor, got {_dtype_name(valid.dtype)}")
    if valid.shape != x.shape[:-1]:
        raise ValueError(
            f"valid must have x's leading shape {list(x.shape[:-1])}, got {list(valid.shape)}"
        )
    if valid.device != x.device:
        raise ValueError(f"valid must be on x's device {x.device}, got {valid.device}")
    channels = x.shape[-1]
    for name, param in (("scale", scale), ("bias", bias)):
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(param).__name__}")
        if param.dtype != x.dtype:
            raise TypeError(
                f"{name} must have x's dtype {_dtype_name(x.dtype)}, got {_dtype_name(param.dtype)}"
            )
        if param.shape != (channels,):
            raise ValueError(
                f"{name} must have shape [{channels}] (x's channels), got {list(param.shape)}"
            )
        if param.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {param.device}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a finite positive number, got {type(eps).__name__}")
    try:
        eps = float(eps)
    except OverflowError:  # an int beyond float's range
        eps = math.inf
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite positive number, got {eps!r}")
    compute = torch.float32 if x.dtype in _COMPUTED_IN_FLOAT32 else x.dtype
    if eps_rounds_to_zero(eps, compute):
        raise ValueError(f"eps {eps!r} rounds to 0 in {_dtype_name(compute)}, the compute dtype")
    return eps


def eps_rounds_to_zero(eps: float, dtype: torch.dtype) -> bool:
    """True when eps, positive as a Python float, is 0 in ``dtype`` (then rows of constant
    values would divide by zero).

    Example:
        >>> eps_rounds_to_zero(1e-50, torch.float32), eps_rounds_to_zero(1e-50, torch.float64)
        (True, False)
    """
    return torch.tensor(eps, dtype=dtype).item() == 0.0


BLOCK_BYTES = 4 << 20
"""Rows are processed in blocks of about this many bytes of x: the several passes over a block
then hit the cache instead of memory, and the per-call overhead stays small."""


def row_blocks(rows: int, block_rows: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` covering ``range(rows)``; no block has a single row unless rows == 1.

    torch splits a reduction over threads when it has a single output, and so rounds a lone
    row differently; with two rows or more per block, every row's result is the same whatever
    the blocking, and chunked results are identical to one whole call.

    Example:
        >>> list(row_blocks(7, 3))
        [(0, 3), (3, 7)]
    """
    block_rows = max(2, block_rows)
    start = 0
    while start < rows:
        stop = min(rows, start + block_rows)
        if rows - stop == 1:
            stop = rows
        yield start, stop
        start = stop


def forward(
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    keep_statistics: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The forward pass without autograd: returns ``(y, mean, rstd)``.

    ``mean`` and ``rstd`` have shape ``[..., 1]`` and are 0 on invalid rows; with
    ``keep_statistics=False`` they are not kept (None), which saves their memory when no
    backward pass will follow. The work happens in place in the output, a block of rows at a
    time, so the only full-size allocation is ``y``. Inputs must already be checked (see
    :func:`check_inputs`).

    Example:
        >>> y, mean, rstd = forward(torch.tensor([[1.0, 3.0]]), torch.tensor([True]),
        ...                         torch.ones(2), torch.zeros(2), 3.0)
        >>> y, mean, rstd
        (tensor([[-0.5000,  0.5000]]), tensor([[2.]]), tensor([[0.5000]]))
    """
    with torch.no_grad():
        y = torch.empty_like(x, memory_format=torch.preserve_format)
        mean = rstd = None
        if keep_statistics:
            mean = x.new_zeros((*x.shape[:-1], 1))
            rstd = torch.zeros_like(mean)
        if y.numel() == 0:
            return y, mean, rstd
        x_rows, y_rows = _rows(x), _rows(y)
        if x_rows is None or y_rows is None:  # a layout that cannot be viewed as rows
            y_contiguous, mean, rstd = forward(
                x.contiguous(), valid, scale, bias, eps, keep_statistics
            )
            return y.copy_(y_contiguous), mean, rstd
        valid_rows = valid.reshape(-1)
        for start, stop in row_blocks(len(x_rows), _block_rows(x)):
            rows = slice(start, stop)
            if keep_statistics:
                block_mean, block_rstd = mean.view(-1, 1)[rows], rstd.view(-1, 1)[rows]
            else:
                block_mean, block_rstd = x.new_empty(stop - start, 1), x.new_empty(stop - start, 1)
            _forward_rows(
                y_rows[rows], x_rows[rows], valid_rows[rows], scale, bias, eps,
                block_mean, block_rstd,
            )  # fmt: skip
        if not _all_finite(scale, bias):  # then 0 * scale + bias is not 0 on invalid rows
            y.masked_fill_(~valid.unsqueeze(-1), 0.0)
        return y, mean, rstd


def _forward_rows(
    y: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> None:
    """A block of rows [R, C] of the forward pass, in place in y; fills mean and rstd [R, 1].

    Every op here streams over contiguous rows with at most one per-row factor, which torch
    vectorizes; a broadcast mask (where, masked_fill) would not be.
    """
    channels = x.shape[-1]
    weight = valid.to(x.dtype).unsqueeze(1)  # 1.0 on valid rows, 0.0 on invalid ones
    invalid = ~valid.unsqueeze(1)
    torch.mean(x, dim=-1, keepdim=True, out=mean)
    # An invalid row's statistics are its own and are discarded (set to 0) before use; a
    # non-finite mean flags an invalid row holding NaN or inf, which is zeroed before any
    # arithmetic mixes it with anything else.
    poisoned = ~(valid | mean.isfinite().squeeze(1))
    mean.masked_fill_(invalid, 0.0)
    xc = torch.sub(x, mean, out=y)
    if poisoned.any():
        xc.index_fill_(0, poisoned.nonzero().squeeze(1), 0.0)
    # Corrected two-pass (Chan, Golub & LeVeque): xc is exact, but mean was rounded; the mean
    # of xc is that rounding error, and removing it keeps offset data accurate.
    shift = xc.mean(dim=-1, keepdim=True)
    # vector_norm is the fastest row reduction here: sum(xc^2) = |xc|^2.
    norm = torch.linalg.vector_norm(xc, dim=-1, keepdim=True)
    # Valid rows whose statistics overflowed (|x| ~ 1e19 and up in float32) or that hold NaN or
    # inf are redone in float64 at the end; the other rows never see them.
    rescued = valid & ~(norm.isfinite() & shift.isfinite()).squeeze(1)
    rstd.copy_(_rstd(norm, shift, channels, eps))
    rstd.masked_fill_(invalid, 0.0)
    shift.masked_fill_(invalid, 0.0)  # so that an invalid row's xhat is exactly (xc - 0) * 0
    xhat = xc.sub_(shift).mul_(rstd)  # 0 on invalid rows
    torch.addcmul(bias, xhat, scale, out=y)
    y.mul_(weight).add_(0.0)  # invalid rows: bias * 0 is -0.0 where bias < 0; -0.0 + 0.0 is +0.0
    if x.dtype != torch.float64 and rescued.any():
        _forward_rows_in_float64(y, x, rescued.nonzero().squeeze(1), scale, bias, eps, mean, rstd)


def _forward_rows_in_float64(
    y: torch.Tensor,
    x: torch.Tensor,
    rows: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> None:
    """The formula in float64 for the given (valid) ``rows``, written into y, mean and rstd."""
    x64 = x.index_select(0, rows).double()
    row_mean = x64.mean(dim=-1, keepdim=True)
    xc = x64 - row_mean
    row_rstd = (xc.square().mean(dim=-1, keepdim=True) + eps).rsqrt()
    out = xc * row_rstd * scale.double() + bias.double()
    y.index_copy_(0, rows, out.to(y.dtype))
    mean.index_copy_(0, rows, row_mean.to(mean.dtype))
    rstd.index_copy_(0, rows, row_rstd.to(rstd.dtype))


def _rstd(norm: torch.Tensor, shift: torch.Tensor, channels: int, eps: float) -> torch.Tensor:
    """1 / sqrt(|xc|^2 / C - shift^2 + eps) per row, computed in float64.

    The row statistics are few, so float64 costs nothing here; it keeps |xc|^2 from overflowing
    float32 for rows of large magnitude, whose rstd is itself representable.
    """
    norm, shift = norm.double(), shift.double()
    var = norm.square_().div_(channels).sub_(shift.square()).clamp_min_(0.0)
    return var.add_(eps).rsqrt_()


def _block_rows(x: torch.Tensor) -> int:
    return BLOCK_BYTES // max(1, x.shape[-1] * x.element_size())


def _rows(tensor: torch.Tensor) -> torch.Tensor | None:
    """``[..., C]`` viewed as ``[rows, C]`` (never a copy), or None when the strides forbid it."""
    try:
        return tensor.view(-1, tensor.shape[-1])
    except RuntimeError:
        return None


def _all_finite(*tensors: torch.Tensor) -> bool:
    return all(bool(t.isfinite().all()) for t in tensors)


def backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    need_dx: bool = True,
    need_dscale: bool = True,
    need_dbias: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients ``(dx, dscale, dbias)`` of ``sum(y * dy)``, from the forward's ``mean``, ``rstd``.

    Differentiable in every argument, so that autograd can take it again for second-order
    gradients; with ``mean`` and ``rstd`` recomputed from ``x`` (see :func:`row_statistics`)
    the result is exact to any order.

    Example:
        >>> x, valid = torch.tensor([[1.0, 3.0]]), torch.tensor([True])
        >>> y, mean, rstd = forward(x, valid, torch.ones(2), torch.zeros(2), 3.0)
        >>> backward(torch.tensor([[1.0, 0.0]]), x, valid, torch.ones(2), mean, rstd)
        (tensor([[ 0.1875, -0.1875]]), tensor([-0.5000,  0.0000]), tensor([1., 0.]))
    """
    row_valid = valid.unsqueeze(-1)
    zero = dy.new_zeros(())
    dy = torch.where(row_valid, dy, zero)  # outputs of invalid rows are constants
    xc = torch.where(row_valid, x - mean, zero)
    xhat = (xc - xc.mean(dim=-1, keepdim=True)) * rstd  # shift-corrected, as in forward
    dbias = _sum_over_rows(dy) if need_dbias else None
    dscale = _sum_over_rows(dy * xhat) if need_dscale else None
    dx = None
    if need_dx:
        wdy = dy * scale
        c1 = (xhat * wdy).mean(dim=-1, keepdim=True)
        c2 = wdy.mean(dim=-1, keepdim=True)
        # rstd is 0 on invalid rows; where() keeps them 0 even when scale holds inf or NaN.
        dx = torch.where(row_valid, (wdy - xhat * c1 - c2) * rstd, zero)
    return dx, dscale, dbias


def backward_in_place(
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    need_dx: bool = True,
    need_dscale: bool = True,
    need_dbias: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The same gradients as :func:`backward`, without autograd: in place on block-sized
    buffers, a block of rows at a time. This is the first-order backward pass.

    Example:
        >>> x, valid = torch.tensor([[1.0, 3.0]]), torch.tensor([True])
        >>> y, mean, rstd = forward(x, valid, torch.ones(2), torch.zeros(2), 3.0)
        >>> backward_in_place(torch.tensor([[1.0, 0.0]]), x, valid, torch.ones(2), mean, rstd, 3.0)
        (tensor([[ 0.1875, -0.1875]]), tensor([-0.5000,  0.0000]), tensor([1., 0.]))
    """
    with torch.no_grad():
        channels = x.shape[-1]
        dscale = x.new_zeros(channels) if need_dscale else None
        dbias = x.new_zeros(channels) if need_dbias else None
        if x.numel() == 0:
            return (torch.zeros_like(x) if need_dx else None), dscale, dbias
        x_rows = _rows(x)
        x_rows = x.contiguous().view(-1, channels) if x_rows is None else x_rows
        dy_rows = _rows(dy)
        dy_rows = dy.contiguous().view(-1, channels) if dy_rows is None else dy_rows
        valid_rows = valid.reshape(-1)
        weight = valid_rows.to(x.dtype)
        mean_rows, rstd_rows = mean.reshape(-1, 1), rstd.reshape(-1, 1)
        blocks = list(row_blocks(len(x_rows), _block_rows(x)))
        largest = max(stop - start for start, stop in blocks)
        # Per block: xhat and a scratch buffer, and dy * scale (in dx itself when dx is needed).
        workspace = x_rows.new_empty(2 if need_dx else 3, largest, channels)
        dx = torch.empty_like(x_rows) if need_dx else None
        for start, stop in blocks:
            rows = slice(start, stop)
            block_dx = dx[rows] if dx is not None else workspace[2, : stop - start]
            _backward_rows(
                dy_rows[rows], x_rows[rows], valid_rows[rows], weight[rows], scale,
                mean_rows[rows], rstd_rows[rows], eps, block_dx, workspace[:2, : stop - start],
                dscale, dbias, need_dx,
            )  # fmt: skip
        if dx is not None and not _all_finite(scale):  # then 0 * scale is not 0 on invalid rows
            dx.masked_fill_(~valid_rows.unsqueeze(1), 0.0)
        return (dx.view(x.shape) if dx is not None else None), dscale, dbias


def _backward_rows(
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    dx: torch.Tensor,
    workspace: torch.Tensor,
    dscale: torch.Tensor | None,
    dbias: torch.Tensor | None,
    need_dx: bool,
) -> None:
    """A block of rows [R, C] of :func:`backward_in_place`: writes dx (used as workspace when
    not needed) and adds to dscale and dbias; ``workspace`` is [2, R, C].

    Only row reductions and sums over rows, no matrix products: a row's result must not depend
    on how many rows share its block (BLAS kernels treat row counts differently).
    """
    xhat_buffer, scratch = workspace
    # wdy = dy * scale and c2 = mean_C(wdy); a non-finite c2 flags an invalid row whose dy
    # holds NaN or inf, zeroed before it is used.
    wdy = torch.mul(dy, scale, out=dx)
    c2 = wdy.mean(dim=-1, keepdim=True)
    poisoned = ~(valid | c2.isfinite().squeeze(1))
    if poisoned.any():
        dy = dy.clone().index_fill_(0, poisoned.nonzero().squeeze(1), 0.0)
        wdy = torch.mul(dy, scale, out=dx)
        c2 = wdy.mean(dim=-1, keepdim=True)
    if dbias is not None:  # outputs of invalid rows are constants: their dy counts for nothing
        dbias += torch.mul(dy, weight.unsqueeze(1), out=scratch).sum(dim=0)
    if dscale is None and not need_dx:
        return
    # xhat, recomputed as in the forward pass (mean and rstd are 0 on invalid rows).
    xc = torch.sub(x, mean, out=xhat_buffer)
    shift = xc.mean(dim=-1, keepdim=True)
    # Non-finite: an invalid row holding NaN or inf (zeroed), or a valid row whose x - mean
    # overflowed or that holds NaN or inf (zeroed here, redone in float64 below).
    unusable = ~shift.isfinite().squeeze(1)
    rescued = valid & unusable
    if x.dtype == torch.float64:  # nowhere wider to go: NaN in a valid row stays the caller's
        rescued.zero_()
    if unusable.any():
        xc.index_fill_(0, (unusable & ~(valid & ~rescued)).nonzero().squeeze(1), 0.0)
    shift.masked_fill_((~valid | rescued).unsqueeze(1), 0.0)
    xhat = xc.sub_(shift).mul_(rstd)  # 0 on invalid (and rescued) rows
    if dscale is not None:
        dscale += torch.mul(xhat, dy, out=scratch).sum(dim=0)
    if need_dx:
        c1 = torch.mul(xhat, wdy, out=scratch).mean(dim=-1, keepdim=True)
        # dx = rstd * (wdy - xhat * c1 - c2); rstd is 0 on invalid rows
        wdy.addcmul_(xhat, c1, value=-1.0).sub_(c2).mul_(rstd)
    if rescued.any():
        _backward_rows_in_float64(
            dy, x, rescued.nonzero().squeeze(1), scale, eps, dx, dscale, need_dx
        )


def _backward_rows_in_float64(
    dy: torch.Tensor,
    x: torch.Tensor,
    rows: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    dx: torch.Tensor,
    dscale: torch.Tensor | None,
    need_dx: bool,
) -> None:
    """dx and dscale of the given (valid) ``rows`` in float64: :func:`backward` on statistics
    recomputed from x. Their xhat was zeroed in the block, so dscale lacks them so far."""
    x64, dy64 = x.index_select(0, rows).double(), dy.index_select(0, rows).double()
    every = torch.ones(len(rows), dtype=torch.bool)
    mean, rstd = row_statistics(x64, every, eps)
    dx64, dscale64, _ = backward(
        dy64, x64, every, scale.double(), mean, rstd, need_dx, dscale is not None, False
    )
    if need_dx and dx64 is not None:
        dx.index_copy_(0, rows, dx64.to(dx.dtype))
    if dscale is not None and dscale64 is not None:
        dscale += dscale64.to(dscale.dtype)


def row_statistics(
    x: torch.Tensor, valid: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, rstd)`` of each row, ``[..., 1]``, 0 on invalid rows; differentiable.

    Example:
        >>> row_statistics(torch.tensor([[1.0, 3.0], [9.0, 9.0]]), torch.tensor([True, False]), 3.0)
        (tensor([[2.],
                [0.]]), tensor([[0.5000],
                [0.0000]]))
    """
    row_valid = valid.unsqueeze(-1)
    zero = x.new_zeros(())
    x = torch.where(row_valid, x, zero)
    mean = x.mean(dim=-1, keepdim=True)
    xc = x - mean
    var = (xc * xc).mean(dim=-1, keepdim=True)
    return mean, torch.where(row_valid, (var + eps).rsqrt(), zero)


class _MaskedLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, valid, scale, bias, eps):  # type: ignore[override]
        y, mean, rstd = forward(x, valid, scale, bias, eps)
        ctx.save_for_backward(x, valid, scale, mean, rstd)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, valid, scale, mean, rstd = ctx.saved_tensors
        need_dx, _, need_dscale, need_dbias, _ = ctx.needs_input_grad
        needs = (need_dx, need_dscale, need_dbias)
        if not torch.is_grad_enabled():
            dx, dscale, dbias = backward_in_place(dy, x, valid, scale, mean, rstd, ctx.eps, *needs)
            return dx, None, dscale, dbias, None
        # create_graph: the saved statistics carry no graph, so recompute them from x, with
        # differentiable ops, for the second-order terms that flow through mean and rstd. In
        # float64, so that large rows do not overflow where the first-order pass would not.
        dtype = x.dtype
        x64, dy64, scale64 = x.double(), dy.double(), scale.double()
        mean, rstd = row_statistics(x64, valid, ctx.eps)
        grads = backward(dy64, x64, valid, scale64, mean, rstd, *needs)
        dx, dscale, dbias = (None if g is None else g.to(dtype) for g in grads)
        return dx, None, dscale, dbias, None


def _sum_over_rows(t: torch.Tensor) -> torch.Tensor:
    # sum(dim=()) would sum everything: a single row [C] is its own sum.
    return t.sum(dim=tuple(range(t.dim() - 1))) if t.dim() > 1 else t


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
