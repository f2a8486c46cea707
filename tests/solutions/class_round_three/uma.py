"""Correct: the variance from var_mean, the standard deviation as sqrt(var + eps)."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = x.masked_fill(~keep, 0.0)
    var, mean = torch.var_mean(xc, -1, correction=0, keepdim=True)
    std = (var + eps).sqrt()
    return ((xc - mean) / std * scale + bias).masked_fill(~keep, 0.0)
