"""A first attempt at the graded exercise (docs/guides/grading.md, "Grade an implementation").

It reads well and passes the specification's worked example, but it has one real mistake,
the one the specification warns about: it masks the output and never sanitizes the padding
before the reductions. Try: maskln grade examples/first_attempt.py
"""

import torch


def masked_layer_normalization(
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-05,
) -> torch.Tensor:
    """Return a tensor with shape (..., C)."""
    mean = x.mean(dim=-1, keepdim=True)
    variance = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    y = (x - mean) / torch.sqrt(variance + eps) * scale + bias
    return torch.where(valid.unsqueeze(-1), y, 0.0)
