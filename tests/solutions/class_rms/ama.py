"""Correct: the mean square accumulated in float64, the result cast back to x's dtype."""

import torch


def masked_rms_normalization(x, valid, scale, eps=1e-6):
    keep = valid.unsqueeze(-1)
    clean = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device)).double()
    mean_square = (clean * clean).sum(dim=-1, keepdim=True) / x.shape[-1]
    y = clean / torch.sqrt(mean_square + eps) * scale.double()
    return torch.where(keep, y, 0.0).to(x.dtype)
