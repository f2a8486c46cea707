"""The recipe docs/op/module.md gave before swap_layer_norms existed: a MaskedLayerNorm subclass
fed the attention mask by a forward pre-hook (test_registered_op counts its compiled graphs)."""

from __future__ import annotations

import torch
from torch import nn

from maskln_cli import MaskedLayerNorm


class PaddingAwareLayerNorm(MaskedLayerNorm):
    """Stands in for an nn.LayerNorm; valid is the model's attention_mask of this batch."""

    valid: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        valid = self.valid
        if valid is None or valid.shape != hidden.shape[:-1]:  # no mask, or not [batch, seq]
            valid = torch.ones(hidden.shape[:-1], dtype=torch.bool, device=hidden.device)
        return super().forward(hidden, valid)


def use_masked_layer_norms(model: nn.Module) -> nn.Module:
    """Swap every nn.LayerNorm of ``model`` for a PaddingAwareLayerNorm fed its attention_mask."""
    norms = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.LayerNorm):
            norms.append(PaddingAwareLayerNorm.from_layer_norm(module))
            model.set_submodule(name, norms[-1])

    def set_mask(_, args, kwargs):
        for norm in norms:
            norm.valid = kwargs.get("attention_mask")

    model.register_forward_pre_hook(set_mask, with_kwargs=True)
    return model
