"""Wrong: eps added outside the square root."""

import torch


def masked_rms_normalization(x, valid, scale, eps=1e-6):
    keep = valid.unsqueeze(-1)
    x = torch.where(keep, x, 0.0)
    y = x / (torch.sqrt(x.pow(2).mean(-1, keepdim=True)) + eps) * scale
    return torch.where(keep, y, 0.0)
