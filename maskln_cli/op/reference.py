"""A float64 reference for masked layer and RMS normalization, written as the formulas read.

It is deliberately plain (out-of-place, float64, a corrected two-pass variance, no shared code
with the op's kernels): tests and the sample data's expected outputs are checked against it,
and it is differentiable, so its autograd gradients are a reference for the op's backward pass
too.
"""

from __future__ import annotations

import torch


def reference_masked_layer_norm(
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-05,
) -> torch.Tensor:
    """Masked layer normalization computed in float64; returns a float64 tensor.

    Example:
        >>> x = torch.tensor([[1.0, 3.0], [99.0, -99.0]])
        >>> reference_masked_layer_norm(x, torch.tensor([True, False]),
        ...                             torch.tensor([2.0, -1.0]), torch.tensor([0.5, 1.0]), 3.0)
        tensor([[-0.5000,  0.5000],
                [ 0.0000,  0.0000]], dtype=torch.float64)
    """
    keep = valid[..., None]
    x = torch.where(keep, x.double(), 0.0)
    mean = x.mean(dim=-1, keepdim=True)
    # The deviations' own mean is the rounding error of the mean: removed (the corrected
    # two-pass of Chan, Golub & LeVeque), rows of a tiny spread on a large offset stay exact to
    # float64's resolution (at -1e-144 +- 1e-150 they were 5e-11 off without it).
    centered = x - mean
    centered = centered - centered.mean(dim=-1, keepdim=True)
    return torch.where(keep, _normalized(centered, eps) * scale.double() + bias.double(), 0.0)


def reference_masked_rms_norm(
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    eps: float = 1e-06,
    offset: float = 0.0,
) -> torch.Tensor:
    """Masked RMS normalization computed in float64: ``x / sqrt(mean(x**2) + eps) * (offset +
    scale)`` on valid rows, 0 on invalid ones; returns a float64 tensor.

    Example:
        >>> x = torch.tensor([[3.0, 4.0], [99.0, -99.0]])
        >>> reference_masked_rms_norm(x, torch.tensor([True, False]),
        ...                           torch.tensor([0.0, 1.0]), 3.5, offset=1.0)
        tensor([[0.7500, 2.0000],
                [0.0000, 0.0000]], dtype=torch.float64)
    """
    keep = valid[..., None]
    x = torch.where(keep, x.double(), 0.0)
    return torch.where(keep, _normalized(x, eps) * (offset + scale.double()), 0.0)


def _normalized(deviations: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row over the root of its mean square plus eps."""
    variance = (deviations**2).mean(dim=-1, keepdim=True)
    return deviations / torch.sqrt(variance + eps)
