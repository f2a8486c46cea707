"""Wrong: the padding sanitized by multiplying by the mask: NaN * 0 is NaN."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    m = valid.unsqueeze(-1).to(x.dtype)
    xc = x * m
    mean = xc.mean(-1, keepdim=True)
    var = ((xc - mean) ** 2).mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(m > 0, y, 0.0)
