"""A correct solution, written as a careful learner would: it passes every clause, strict ones
included (maskln grade tests/solutions/correct.py --strict exits 0)."""

import torch


def masked_layer_normalization(
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-05,
) -> torch.Tensor:
    """Return a tensor with shape (..., C)."""
    padding = ~valid.unsqueeze(-1)
    # Sanitize first: NaN or inf in a padded row must not reach a reduction (0 * NaN is NaN).
    x_clean = x.masked_fill(padding, 0.0)
    mean = x_clean.mean(dim=-1, keepdim=True)
    centered = x_clean - mean
    variance = (centered * centered).mean(dim=-1, keepdim=True)  # population variance
    y = centered / torch.sqrt(variance + eps) * scale + bias
    y = y.masked_fill(padding, 0.0)  # after the bias: padded rows are exactly +0.0
    # The output keeps x's memory layout, as torch.empty_like(x) has it.
    return torch.empty_like(x).copy_(y)
