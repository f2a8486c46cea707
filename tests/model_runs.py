"""A padded batch through a tiny transformers model, one norm module's tensors captured: what
the checkpoint tests of LayerNorm models (``test_transformers_checkpoints.py``) and of
LLaMA-family RMSNorm models (``test_rms_checkpoints.py``) both run."""

from __future__ import annotations

import torch

LENGTHS = (9, 5, 2)
"""The batch's sequence lengths: the rest of each row of ``max(LENGTHS)`` is padding."""


def run_padded_batch(model: torch.nn.Module, module: torch.nn.Module):
    """Run a padded batch with an int64 attention mask through ``model``, under a loss over the
    valid positions only; hooks capture ``module``'s input and output, and the gradients
    through it alone (in a pre-norm model x also feeds the residual path, so x's own .grad
    would hold more than the norm's part). Returns the dump's tensors (``x``,
    ``attention_mask``, ``grad_out``) and the module's own ``out`` and ``grad_x``; its
    parameters' ``.grad`` hold their gradients."""
    captured = {}

    def forward_hook(_, inputs, output):
        captured["x"], captured["out"] = inputs[0].detach(), output.detach()

    def backward_hook(_, grad_input, grad_output):
        captured["grad_x"], captured["grad_out"] = grad_input[0], grad_output[0]

    handles = [
        module.register_forward_hook(forward_hook),
        module.register_full_backward_hook(backward_hook),
    ]
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 30, (len(LENGTHS), max(LENGTHS)), generator=generator)
    positions = torch.arange(max(LENGTHS))
    attention_mask = (positions[None, :] < torch.tensor(LENGTHS)[:, None]).long()  # int64
    hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    weights = torch.randn(hidden.shape, generator=generator)
    model.zero_grad()
    (hidden * weights * attention_mask[..., None]).sum().backward()  # a loss over valid positions
    for handle in handles:
        handle.remove()
    acts = {"x": captured["x"], "attention_mask": attention_mask, "grad_out": captured["grad_out"]}
    return acts, {"out": captured["out"], "grad_x": captured["grad_x"]}
