"""Wrong: the result written into torch.zeros(x.shape), float32 whatever x is."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    out = torch.zeros(x.shape)
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = ((xc - mean) ** 2).mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    out[valid] = y[valid]
    return out
