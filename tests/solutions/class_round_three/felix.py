"""Wrong: bias forgotten, xhat * scale."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    d = xc - xc.mean(-1, keepdim=True)
    y = d * torch.rsqrt(d.square().mean(-1, keepdim=True) + eps) * scale
    return torch.where(keep, y, 0.0)
