"""Wrong: one-pass variance E[x**2] - E[x]**2, in the input's precision."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc * xc).mean(-1, keepdim=True) - mean * mean
    y = (xc - mean) / torch.sqrt(var.clamp_min(0.0) + eps) * scale + bias
    return torch.where(keep, y, 0.0)
