"""``MaskedLayerNorm``: the op as an ``nn.Module``, a drop-in for ``nn.LayerNorm`` over the last
axis that takes a mask.

Its parameters are named ``weight`` and ``bias``, as ``nn.LayerNorm``'s are, so a state_dict
moves between the two unchanged.
"""

from __future__ import annotations

import operator
from typing import Any, ClassVar

import torch
from torch import nn

from maskln_cli.op.api import masked_layer_normalization
from maskln_cli.op.checks import as_valid_mask, quiet_when_traced

__all__ = ["MaskedLayerNorm"]


class MaskedLayerNorm(nn.Module):
    """Layer normalization over the last axis of the valid positions; padding gives +0.0.

    Args:
        normalized_shape: C, the size of the last axis (an int, or a 1-tuple as
            ``nn.LayerNorm`` takes it).
        eps: added to the population variance inside the sqrt.
        elementwise_affine: learn ``weight`` (ones at first) and, with ``bias``, ``bias``
            (zeros at first); without, the normalized values are returned as they are.
        bias: learn ``bias`` too (with ``elementwise_affine``).
        device, dtype: of the parameters.

    ``forward(x, valid)``: x ``[..., C]``; valid ``[...]``, by maskln's one mask rule (as
    :func:`masked_layer_normalization` takes it): bool, or an integer or floating tensor holding
    only 0 and 1, 1 meaning valid, such as a transformers ``attention_mask``. Any other value is
    refused, naming it: a mask holding 2 is not "nonzero, so valid", and a floating mask holding
    -inf is an additive mask, which read as 0/1 would silently invert.

    In a model whose layer norms are called with the hidden states alone (transformers),
    :func:`maskln_cli.swap_layer_norms` swaps them in and hands them the model's mask.

    Example:
        >>> norm = MaskedLayerNorm(2, eps=3.0)
        >>> norm(torch.tensor([[1.0, 3.0], [99.0, -99.0]]), torch.tensor([1, 0])).tolist()
        [[-0.5, 0.5], [0.0, 0.0]]
        >>> norm
        MaskedLayerNorm((2,), eps=3.0, elementwise_affine=True)
    """

    __constants__: ClassVar[list[str]] = ["normalized_shape", "eps", "elementwise_affine"]
    normalized_shape: tuple[int]
    eps: float
    elementwise_affine: bool

    def __init__(
        self,
        normalized_shape: int | tuple[int] | list[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(normalized_shape, int):
            if isinstance(normalized_shape, str) or len(normalized_shape) != 1:
                raise ValueError(
                    f"normalized_shape must be one size (the last axis), got {normalized_shape!r}"
                )
            (normalized_shape,) = normalized_shape
        self.normalized_shape = (operator.index(normalized_shape),)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            if bias:
                self.bias = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """weight to ones, bias to zeros (as ``nn.LayerNorm``)."""
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @classmethod
    def from_layer_norm(cls, layer_norm: nn.LayerNorm) -> MaskedLayerNorm:
        """A MaskedLayerNorm with ``layer_norm``'s size, eps and a copy of its parameters.

        Example:
            >>> MaskedLayerNorm.from_layer_norm(nn.LayerNorm(8, eps=1e-12, bias=False))
            MaskedLayerNorm((8,), eps=1e-12, elementwise_affine=True, bias=False)
        """
        if not isinstance(layer_norm, nn.LayerNorm):  # RMSNorm has no bias and no mean
            raise TypeError(
                f"from_layer_norm: expected an nn.LayerNorm, got {type(layer_norm).__name__}"
            )
        if len(layer_norm.normalized_shape) != 1:
            raise ValueError(
                "from_layer_norm: MaskedLayerNorm normalizes the last axis only; this LayerNorm"
                f" normalizes {list(layer_norm.normalized_shape)}"
            )
        reference = layer_norm.weight if layer_norm.weight is not None else None
        module = cls(
            layer_norm.normalized_shape,
            eps=layer_norm.eps,
            elementwise_affine=layer_norm.elementwise_affine,
            bias=layer_norm.bias is not None,
            device=None if reference is None else reference.device,
            dtype=None if reference is None else reference.dtype,
        )
        module.load_state_dict(layer_norm.state_dict())
        return module

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        valid = as_valid_mask(valid)  # before x's checks: the op's order of messages
        quiet_when_traced()
        channels = self.normalized_shape[0]
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != channels:
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have {channels} channels (its last axis), got {got}")
        weight = self.weight
        bias = self.bias
        if weight is None:
            weight = torch.ones(channels, dtype=x.dtype, device=x.device)
        if bias is None:
            bias = torch.zeros(channels, dtype=weight.dtype, device=x.device)
        return masked_layer_normalization(x, valid, weight, bias, self.eps)

    def extra_repr(self) -> str:
        text = f"{self.normalized_shape}, eps={self.eps}"
        text += f", elementwise_affine={self.elementwise_affine}"
        if self.elementwise_affine and self.bias is None:
            text += ", bias=False"
        return text
