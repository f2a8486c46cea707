"""Wrong: the mean square divided by C - 1, as an unbiased variance is."""

import torch


def masked_rms_normalization(x, valid, scale, eps=1e-6):
    keep = valid.unsqueeze(-1)
    x = torch.where(keep, x, 0.0)
    mean_square = x.pow(2).sum(-1, keepdim=True) / (x.shape[-1] - 1)
    y = x / torch.sqrt(mean_square + eps) * scale
    return torch.where(keep, y, 0.0)
