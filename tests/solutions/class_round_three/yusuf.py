"""Wrong: valid used without [..., None]: it broadcasts against the channels."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    xc = x.masked_fill(~valid, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).pow(2).mean(-1, keepdim=True)
    return ((xc - mean) / torch.sqrt(var + eps) * scale + bias).masked_fill(~valid, 0.0)
