"""Wrong: the mask applied before the bias: invalid rows return bias."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = ((xc - mean) ** 2).mean(-1, keepdim=True)
    xhat = torch.where(keep, (xc - mean) / torch.sqrt(var + eps), 0.0)
    return xhat * scale + bias
