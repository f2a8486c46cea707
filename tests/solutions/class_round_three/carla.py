"""Wrong: eps forgotten, (x - mean) / sqrt(var)."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid[..., None]
    z = torch.where(keep, x, 0.0)
    var, mean = torch.var_mean(z, -1, correction=0, keepdim=True)
    y = (z - mean) * torch.rsqrt(var)
    return torch.where(keep, y * scale + bias, 0.0)
