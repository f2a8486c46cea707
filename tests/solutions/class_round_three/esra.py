"""Wrong: scale forgotten, xhat + bias."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = x.masked_fill(~keep, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).pow(2).mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) + bias
    return y.masked_fill(~keep, 0.0)
