"""The public function: check the arguments, pick the compute dtype, and dispatch."""

from __future__ import annotations

import torch

from maskln_cli.op.autograd import (
    MaskedLayerNormFunction,
    autocast_off,
    traced,
    transformed,
)
from maskln_cli.op.blocked import forward
from maskln_cli.op.checks import as_valid_mask, check_inputs, compute_dtype
from maskln_cli.op.functional import masked_layer_norm_functional

__all__ = ["masked_layer_normalization"]


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
        valid: ``[...]``, exactly ``x``'s leading shape: bool, or an integer or floating
            tensor holding only 0 and 1 (1 = valid; a transformers ``attention_mask`` is
            int64 0/1); any other value is refused. Invalid rows give ``+0.0`` whatever ``x``
            holds there, NaN and inf included.
        scale: ``[C]`` tensor of ``x``'s dtype (or float32, when x is float16 or bfloat16, as
            under autocast), multiplied after normalization.
        bias: ``[C]``, likewise; added after scaling.
        eps: finite positive number added to the population variance inside the sqrt.

    Returns:
        A tensor of ``x``'s shape, dtype, device and memory layout (as ``torch.empty_like(x)``).
        It requires grad when ``x``, ``scale`` or ``bias`` does; gradients have each input's own
        dtype; derivatives of any order are supported.

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
    valid = as_valid_mask(valid)
    eps = check_inputs(x, valid, scale, bias, eps)
    dtype = x.dtype
    compute = compute_dtype(dtype)
    # Differentiable casts: gradients come back in each input's own dtype.
    x_, scale_, bias_ = (t if t.dtype == compute else t.to(compute) for t in (x, scale, bias))
    with autocast_off(x.device.type):  # the arithmetic is ours: autocast must not recast it
        if transformed():
            out = masked_layer_norm_functional(x_, valid, scale_, bias_, eps)
        elif torch.compiler.is_compiling() or traced(x, valid, scale, bias):
            out = torch.ops.maskln.masked_layer_norm(x_, valid, scale_, bias_, eps)[0]
        elif torch.is_grad_enabled() and any(t.requires_grad for t in (x_, scale_, bias_)):
            out = MaskedLayerNormFunction.apply(x_, valid, scale_, bias_, eps)[0]
        else:
            out = forward(x_, valid, scale_, bias_, eps, keep_statistics=False)[0]
    return out if out.dtype == dtype else out.to(dtype)
