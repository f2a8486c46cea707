"""Wrong: one mean and variance for the whole batch (over the valid elements), as batch norm."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    count = (keep.sum() * x.shape[-1]).clamp(min=1)
    mean = xc.sum() / count
    var = (torch.where(keep, xc - mean, 0.0) ** 2).sum() / count
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)
