"""Correct: masked_fill and torch.var with unbiased=False."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    pad = ~valid.unsqueeze(-1)
    x = x.masked_fill(pad, 0)
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    out = (x - mean) / torch.sqrt(var + eps) * scale + bias
    return out.masked_fill(pad, 0)
