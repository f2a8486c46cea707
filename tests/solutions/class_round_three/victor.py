"""Correct, unusual: the mask made a float, then compared with 0.5 to select with torch.where."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    m = valid.to(x.dtype).unsqueeze(-1)
    keep = m > 0.5
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).pow(2).mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(keep, y, 0.0)
