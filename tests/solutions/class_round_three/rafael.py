"""Wrong: assumes x is [B, N, C]."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    B, N, C = x.shape
    keep = valid.view(B, N, 1).expand(B, N, C)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(2, keepdim=True)
    var = ((xc - mean) ** 2).mean(2, keepdim=True)
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)
