"""Wrong: eps squared (taken for a standard deviation)."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = ((xc - mean) ** 2).mean(-1, keepdim=True)
    std = torch.sqrt(var + eps * eps)
    return torch.where(keep, (xc - mean) / std * scale + bias, 0.0)
