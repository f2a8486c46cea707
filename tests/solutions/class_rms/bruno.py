"""Correct: rsqrt of the mean square, padding filled before and after."""

import torch


def masked_rms_normalization(
    x: torch.Tensor, valid: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    padding = ~valid[..., None]
    x = x.masked_fill(padding, 0.0)
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return (x * rstd * scale).masked_fill(padding, 0.0)
