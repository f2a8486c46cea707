"""Wrong: the mean subtracted first (a LayerNorm without bias, not an RMSNorm)."""

import torch


def masked_rms_normalization(x, valid, scale, eps=1e-6):
    keep = valid.unsqueeze(-1)
    x = torch.where(keep, x, 0.0)
    centered = x - x.mean(-1, keepdim=True)
    y = centered / torch.sqrt(centered.pow(2).mean(-1, keepdim=True) + eps) * scale
    return torch.where(keep, y, 0.0)
