"""The public functions, one per norm: check the arguments, and take the cheapest way to the
kernels (the same ways for both)."""

from __future__ import annotations

import torch

import maskln_cli.op.library  # noqa: F401  (defines torch.ops.maskln's ops)
from maskln_cli.op import backend
from maskln_cli.op.autograd import (
    MaskedLayerNormFunction,
    MaskedRMSNormFunction,
    Way,
    apply_eager,
    call_op,
    composite_forward,
    forward_function,
    forward_way,
)
from maskln_cli.op.checks import as_valid_mask, check_inputs, check_rms_inputs
from maskln_cli.op.norms import LAYER, RMS, Norm

__all__ = ["masked_layer_normalization", "masked_rms_normalization"]


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
    if not backend.within_contract(x, valid, scale, bias, eps, 0.0, LAYER):
        eps = check_inputs(x, valid, scale, bias, eps)
    return _normalized(LAYER, forward_way(x, valid, scale, bias), x, valid, scale, bias, eps, 0.0)


def masked_rms_normalization(
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    eps: float = 1e-06,
    *,
    offset: float = 0.0,
) -> torch.Tensor:
    """RMS-normalize the valid rows of ``x`` over its last axis; zero the invalid rows.

    Each valid row becomes ``x / sqrt(mean(x**2) + eps) * (offset + scale)``: the RMSNorm of
    LLaMA, Mistral, Qwen and T5 with ``offset=0``, Gemma's (whose weight is a zero-centred
    gain) with ``offset=1``. The same arguments, rules and guarantees as
    :func:`masked_layer_normalization`, without the bias and the mean.

    Args:
        x: ``[..., C]`` floating tensor (float32 or float64; float16 and bfloat16 are
            computed in float32 and returned in their own dtype). Any strides.
        valid: ``[...]``, exactly ``x``'s leading shape: bool, or an integer or floating
            tensor holding only 0 and 1 (1 = valid). Invalid rows give ``+0.0`` whatever ``x``
            holds there, NaN and inf included.
        scale: ``[C]`` tensor of ``x``'s dtype (or float32, when x is float16 or bfloat16).
        eps: finite positive number added to the mean square inside the sqrt.
        offset: finite number added to scale: the gain is ``offset + scale``.

    Returns:
        A tensor of ``x``'s shape, dtype, device and memory layout. It requires grad when ``x``
        or ``scale`` does; derivatives of any order are supported.

    Raises:
        TypeError, ValueError: the message names the offending argument.

    Example:
        >>> x = torch.tensor([[[3.0, 4.0], [99.0, -99.0]]], dtype=torch.float64)
        >>> valid = torch.tensor([[True, False]])
        >>> scale = torch.tensor([0.0, 1.0], dtype=torch.float64)
        >>> masked_rms_normalization(x, valid, scale, eps=3.5, offset=1.0)
        tensor([[[0.7500, 2.0000],
                 [0.0000, 0.0000]]], dtype=torch.float64)
    """
    valid = as_valid_mask(valid)
    if not backend.within_contract(x, valid, scale, None, eps, offset, RMS):
        eps, offset = check_rms_inputs(x, valid, scale, eps, offset)
    return _normalized(RMS, forward_way(x, valid, scale, None), x, valid, scale, None, eps, offset)


def _normalized(
    norm: Norm,
    way: Way,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    offset: float,
) -> torch.Tensor:
    """y of checked inputs, the way :data:`~maskln_cli.op.autograd.FORWARD_WAYS` chose."""
    if way is Way.KERNELS:
        return backend.forward(x, valid, scale, bias, eps, False, norm, offset)[0]
    if way is Way.AUTOGRAD:  # every eager call with grad: the Function's C apply, at once
        if norm.centered:
            return apply_eager(MaskedLayerNormFunction, x, valid, scale, bias, eps)[0]
        return apply_eager(MaskedRMSNormFunction, x, valid, scale, eps, offset)[0]
    if way is Way.FUNCTION:  # torch.func, forward-mode AD: torch's route through the transforms
        function, args = forward_function(norm, x, valid, scale, bias, eps, offset)
        return function.apply(*args)[0]
    if way is Way.COMPOSITE:
        return composite_forward(norm, x, valid, scale, bias, eps, offset)[0]
    # a graph is made, or ops watched: the registered op, one node calling the kernels
    return call_op(norm, x, valid, scale, bias, eps, offset)[0]
