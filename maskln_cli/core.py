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

and dx = 0 on invalid rows. Invalid rows of x are replaced by zeros before any reduction, and
their mean and rstd are stored as 0, so whatever they hold (NaN, inf) never reaches an output
or a gradient. ``shift`` is the corrected two-pass algorithm (Chan, Golub & LeVeque, 1983): on
float32 rows with a large common offset it keeps the error near float32's resolution, where a
plain two-pass (torch's own layer_norm included) loses several digits to the rounded mean.
"""

from __future__ import annotations

import math
import numbers

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
    if x.dtype in _COMPUTED_IN_FLOAT32:
        out = masked_layer_normalization(x.float(), valid, scale.float(), bias.float(), eps)
        return out.to(x.dtype)
    if torch.is_grad_enabled() and (x.requires_grad or scale.requires_grad or bias.requires_grad):
        return _MaskedLayerNorm.apply(x, valid, scale, bias, eps)
    return forward(x, valid, scale, bias, eps)[0]


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
    eps = float(eps)
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite positive number, got {eps!r}")
    return eps


def forward(
    x: torch.Tensor, valid: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward pass without autograd: returns ``(y, mean, rstd)``.

    ``mean`` and ``rstd`` have shape ``[..., 1]`` and are 0 on invalid rows. All the work
    happens in place on the one output buffer, so the only full-size allocation is ``y``.
    Inputs must already be checked (see :func:`check_inputs`).

    Example:
        >>> y, mean, rstd = forward(torch.tensor([[1.0, 3.0]]), torch.tensor([True]),
        ...                         torch.ones(2), torch.zeros(2), 3.0)
        >>> y, mean, rstd
        (tensor([[-0.5000,  0.5000]]), tensor([[2.]]), tensor([[0.5000]]))
    """
    with torch.no_grad():
        channels = x.shape[-1]
        row_valid = valid.unsqueeze(-1)
        y = torch.empty_like(x, memory_format=torch.preserve_format)
        if y.numel() == 0:
            stats = x.new_zeros((*x.shape[:-1], 1))
            return y, stats, stats.clone()
        torch.where(row_valid, x, x.new_zeros(()), out=y)  # sanitize: invalid rows -> 0
        mean = y.mean(dim=-1, keepdim=True)
        xc = y.sub_(mean)
        # Corrected two-pass (Chan, Golub & LeVeque): xc is exact, but mean was rounded; the
        # mean of xc is that rounding error, and removing it keeps offset data accurate.
        shift = xc.mean(dim=-1, keepdim=True)
        # vector_norm is the fastest row reduction here: sum(xc^2) = |xc|^2.
        var = torch.linalg.vector_norm(xc, dim=-1, keepdim=True).square_().div_(channels)
        var.sub_(shift.square()).clamp_min_(0.0)
        rstd = var.add_(eps).rsqrt_().mul_(row_valid)
        xhat = torch.addcmul(-shift * rstd, xc, rstd, out=y)
        torch.addcmul(bias, xhat, scale, out=y)
        y.masked_fill_(~row_valid, 0.0)
        return y, mean, rstd


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
        dx = (wdy - xhat * c1 - c2) * rstd
    return dx, dscale, dbias


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
        if torch.is_grad_enabled():
            # create_graph: the saved statistics carry no graph, so recompute them from x for
            # the second-order terms that flow through mean and rstd.
            mean, rstd = row_statistics(x, valid, ctx.eps)
        dx, dscale, dbias = backward(
            dy, x, valid, scale, mean, rstd, need_dx, need_dscale, need_dbias
        )
        return dx, None, dscale, dbias, None


def _sum_over_rows(t: torch.Tensor) -> torch.Tensor:
    # sum(dim=()) would sum everything: a single row [C] is its own sum.
    return t.sum(dim=tuple(range(t.dim() - 1))) if t.dim() > 1 else t


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
