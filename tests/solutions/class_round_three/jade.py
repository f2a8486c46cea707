"""Correct: computed in float64 whatever the input, cast back to x's dtype."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xd = torch.where(keep, x, 0.0).double()
    mean = xd.mean(-1, keepdim=True)
    var = (xd - mean).square().mean(-1, keepdim=True)
    y = (xd - mean) / torch.sqrt(var + eps) * scale.double() + bias.double()
    return torch.where(keep, y, 0.0).to(x.dtype)
