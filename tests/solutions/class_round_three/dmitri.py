"""Wrong: divides by the variance, not its square root."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = ((xc - mean) ** 2).mean(-1, keepdim=True)
    return torch.where(keep, (xc - mean) / (var + eps) * scale + bias, 0.0)
