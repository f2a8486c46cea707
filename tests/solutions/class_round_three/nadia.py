"""Correct: keepdim=False reductions unsqueezed by hand; the output keeps x's layout."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    mask = valid.unsqueeze(-1)
    xz = x.masked_fill(~mask, 0.0)
    mean = xz.mean(dim=-1).unsqueeze(-1)
    var = (xz - mean).pow(2).mean(dim=-1).unsqueeze(-1)
    y = (xz - mean) * (var + eps).rsqrt() * scale + bias
    return torch.empty_like(x).copy_(y.masked_fill(~mask, 0.0))
