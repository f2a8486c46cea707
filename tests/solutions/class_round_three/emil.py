"""Wrong: constant rows "are already normalized": zeros there instead of dividing (their
gradient is lost)."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    d = xc - mean
    var = (d * d).mean(-1, keepdim=True)
    xhat = torch.where(var == 0, torch.zeros_like(d), d / torch.sqrt(var + eps))
    return torch.where(keep, xhat * scale + bias, 0.0)
