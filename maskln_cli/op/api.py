"""The public function: check the arguments, and take the cheapest way to the kernels."""

from __future__ import annotations

import torch

import maskln_cli.op.library  # noqa: F401  (defines torch.ops.maskln.masked_layer_norm)
from maskln_cli.op import backend
from maskln_cli.op.autograd import (
    MaskedLayerNormFunction,
    Way,
    apply_eager,
    composite_forward,
    forward_way,
)
from maskln_cli.op.checks import as_valid_mask, check_inputs

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
    way = forward_way(x, valid, scale, bias)
    if way is Way.KERNELS:
        return backend.forward(x, valid, scale, bias, eps, keep_statistics=False)[0]
    if way is Way.AUTOGRAD:
        return apply_eager(MaskedLayerNormFunction, x, valid, scale, bias, eps)[0]
    if way is Way.FUNCTION:  # torch.func, forward-mode AD: torch's route through the transforms
        return MaskedLayerNormFunction.apply(x, valid, scale, bias, eps)[0]
    if way is Way.COMPOSITE:
        return composite_forward(x, valid, scale, bias, eps)[0]
    # a graph is made, or ops watched: the registered op, one node calling the kernels
    return torch.ops.maskln.masked_layer_norm(x, valid, scale, bias, eps)[0]
