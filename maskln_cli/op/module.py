"""The op as ``nn.Module``s: ``MaskedLayerNorm``, a drop-in for ``nn.LayerNorm`` over the last
axis that takes a mask, and ``MaskedRMSNorm``, the same for ``nn.RMSNorm`` (and the RMSNorms of
LLaMA-family models).

Their parameters are named ``weight`` (and ``bias``), as ``nn.LayerNorm``'s and
``nn.RMSNorm``'s are, so a state_dict moves between them unchanged.
"""

from __future__ import annotations

import operator
from typing import Any, ClassVar

import torch
from torch import nn

from maskln_cli.op.api import masked_layer_normalization, masked_rms_normalization
from maskln_cli.op.checks import as_valid_mask, compute_dtype, quiet_when_traced

__all__ = ["MaskedLayerNorm", "MaskedRMSNorm"]


class MaskedNorm(nn.Module):
    """What the masked norms share: one normalized size (the last axis), an optional ``weight``,
    and the checks of ``forward(x, valid)``."""

    normalized_shape: tuple[int]

    @staticmethod
    def one_size(normalized_shape: int | tuple[int] | list[int]) -> tuple[int]:
        """``normalized_shape`` as the 1-tuple ``(C,)``; a ValueError for several axes."""
        if not isinstance(normalized_shape, int):
            if isinstance(normalized_shape, str) or len(normalized_shape) != 1:
                raise ValueError(
                    f"normalized_shape must be one size (the last axis), got {normalized_shape!r}"
                )
            (normalized_shape,) = normalized_shape
        return (operator.index(normalized_shape),)

    def checked(self, x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight, valid)`` for a call: the weight (ones when there is none) and the mask by
        the one mask rule; a ValueError when x has not the module's channels."""
        valid = as_valid_mask(valid)  # before x's checks: the op's order of messages
        quiet_when_traced()
        channels = self.normalized_shape[0]
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != channels:
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have {channels} channels (its last axis), got {got}")
        weight = self.weight
        if weight is None:
            weight = torch.ones(channels, dtype=x.dtype, device=x.device)
        return weight, valid


class MaskedLayerNorm(MaskedNorm):
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
        self.normalized_shape = self.one_size(normalized_shape)
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
            hint = " (MaskedRMSNorm.from_rms_norm converts it)"
            raise TypeError(
                f"from_layer_norm: expected an nn.LayerNorm, got {type(layer_norm).__name__}"
                + (hint if isinstance(layer_norm, nn.RMSNorm) else "")
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
        weight, valid = self.checked(x, valid)
        bias = self.bias
        if bias is None:
            bias = torch.zeros(self.normalized_shape[0], dtype=weight.dtype, device=x.device)
        return masked_layer_normalization(x, valid, weight, bias, self.eps)

    def extra_repr(self) -> str:
        text = f"{self.normalized_shape}, eps={self.eps}"
        text += f", elementwise_affine={self.elementwise_affine}"
        if self.elementwise_affine and self.bias is None:
            text += ", bias=False"
        return text


class MaskedRMSNorm(MaskedNorm):
    """RMS normalization over the last axis of the valid positions; padding gives +0.0.

    Each valid row becomes ``x / sqrt(mean(x**2) + eps) * (offset + weight)``
    (:func:`masked_rms_normalization`): ``nn.RMSNorm`` and LLaMA's, Mistral's, Qwen's and T5's
    RMSNorm with ``offset=0``, Gemma's with ``offset=1`` (its weight is a zero-centred gain).

    Args:
        normalized_shape: C, the size of the last axis (an int, or a 1-tuple).
        eps: added to the mean square inside the sqrt; None, as ``nn.RMSNorm`` takes it: the
            machine epsilon of the compute dtype (float32's for float32, float16 and bfloat16
            inputs, float64's for float64).
        elementwise_affine: learn ``weight``, at first ``1 - offset`` (a gain of 1: ones, or
            Gemma's zeros); without, the normalized values are returned as they are.
        offset: added to the weight: the gain is ``offset + weight``.
        device, dtype: of the parameters.

    ``forward(x, valid)``: as :class:`MaskedLayerNorm`'s, by the one mask rule.

    Example:
        >>> norm = MaskedRMSNorm(2, eps=3.5, offset=1.0)
        >>> norm(torch.tensor([[3.0, 4.0], [99.0, -99.0]]), torch.tensor([1, 0])).tolist()
        [[0.75, 1.0], [0.0, 0.0]]
        >>> norm
        MaskedRMSNorm((2,), eps=3.5, elementwise_affine=True, offset=1.0)
    """

    __constants__: ClassVar[list[str]] = [
        "normalized_shape", "eps", "elementwise_affine", "offset",
    ]  # fmt: skip
    eps: float | None
    elementwise_affine: bool
    offset: float

    def __init__(
        self,
        normalized_shape: int | tuple[int] | list[int],
        eps: float | None = 1e-6,
        elementwise_affine: bool = True,
        offset: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = self.one_size(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.offset = float(offset)
        if elementwise_affine:
            factory: dict[str, Any] = {"device": device, "dtype": dtype}
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """weight to ``1 - offset``: a gain of 1 (ones, as ``nn.RMSNorm``; Gemma's zeros)."""
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.offset)

    @classmethod
    def from_rms_norm(cls, rms_norm: nn.RMSNorm) -> MaskedRMSNorm:
        """A MaskedRMSNorm with ``rms_norm``'s size, eps and a copy of its weight.

        Example:
            >>> MaskedRMSNorm.from_rms_norm(nn.RMSNorm(8))
            MaskedRMSNorm((8,), eps=None, elementwise_affine=True)
        """
        if not isinstance(rms_norm, nn.RMSNorm):
            raise TypeError(f"from_rms_norm: expected an nn.RMSNorm, got {type(rms_norm).__name__}")
        if len(rms_norm.normalized_shape) != 1:
            raise ValueError(
                "from_rms_norm: MaskedRMSNorm normalizes the last axis only; this RMSNorm"
                f" normalizes {list(rms_norm.normalized_shape)}"
            )
        weight = rms_norm.weight
        module = cls(
            rms_norm.normalized_shape,
            eps=rms_norm.eps,
            elementwise_affine=rms_norm.elementwise_affine,
            device=None if weight is None else weight.device,
            dtype=None if weight is None else weight.dtype,
        )
        module.load_state_dict(rms_norm.state_dict())
        return module

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        weight, valid = self.checked(x, valid)
        eps = self.eps
        if eps is None and x.is_floating_point():  # nn.RMSNorm's: the compute dtype's epsilon
            eps = torch.finfo(compute_dtype(x.dtype)).eps
        offset = self.offset if self.weight is not None else 0.0  # no weight: a gain of 1
        return masked_rms_normalization(x, valid, weight, eps, offset=offset)

    def extra_repr(self) -> str:
        text = f"{self.normalized_shape}, eps={self.eps}"
        text += f", elementwise_affine={self.elementwise_affine}"
        if self.offset:
            text += f", offset={self.offset}"
        return text
