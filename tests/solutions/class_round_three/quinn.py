"""Correct: normalized in float64 whatever the input, cast back to x's dtype before scale and
bias are applied."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xd = torch.where(keep, x, 0.0).to(torch.float64)
    mean = xd.mean(-1, keepdim=True)
    var = ((xd - mean) ** 2).mean(-1, keepdim=True)
    y = ((xd - mean) / torch.sqrt(var + eps)).to(x.dtype) * scale + bias
    return torch.where(keep, y, 0.0)
