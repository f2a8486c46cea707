"""Wrong: scale and bias swapped, xhat * bias + scale."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid[..., None]
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = ((xc - mean) ** 2).mean(-1, keepdim=True)
    return torch.where(keep, torch.addcmul(scale, (xc - mean) / torch.sqrt(var + eps), bias), 0.0)
