"""Tiny transformers models built from their configs (nothing is downloaded), padded batches,
and the float64 reference of a dump's tensors."""

from __future__ import annotations

import torch

from maskln_cli.op.reference import reference_masked_layer_norm
from tests.test_transformers_checkpoints import ARCHITECTURES, LENGTHS, build

__all__ = ["ARCHITECTURES", "LENGTHS", "batch", "build", "reference", "run"]


def batch(lengths=LENGTHS, seed=1, vocab=30):
    """input_ids and an int64 attention_mask (1 = valid) for sequences of ``lengths``."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (len(lengths), max(lengths)), generator=generator)
    positions = torch.arange(max(lengths))
    return input_ids, (positions[None, :] < torch.tensor(lengths)[:, None]).long()


def run(model, input_ids, attention_mask, backward=True, seed=2):
    """A forward pass, and a backward one under a loss over the valid positions only."""
    hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    if backward:
        weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(seed))
        (hidden.float() * weights * attention_mask[..., None]).sum().backward()
    return hidden


def reference(dump, eps):
    """The float64 formula's out and, when the dump has grad_out, its gradients."""
    leaves = [dump[k].detach().double().requires_grad_() for k in ("x", "scale", "bias")]
    out = reference_masked_layer_norm(leaves[0], dump["valid"], leaves[1], leaves[2], eps)
    expected = {"out": out.detach()}
    if "grad_out" in dump:
        grads = torch.autograd.grad(out, leaves, dump["grad_out"].double())
        expected.update(zip(("grad_x", "grad_scale", "grad_bias"), grads, strict=True))
    return expected
