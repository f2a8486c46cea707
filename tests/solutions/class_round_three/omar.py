"""Correct: a kernel-like sum in fixed blocks of 64 channels, the last block partial."""

import torch

BLOCK = 64


def _row_sum(t):
    total = torch.zeros_like(t[..., :1])
    for start in range(0, t.shape[-1], BLOCK):
        total = total + t[..., start : start + BLOCK].sum(-1, keepdim=True)
    return total


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    n = x.shape[-1]
    mean = _row_sum(xc) / n
    d = xc - mean
    var = _row_sum(d * d) / n
    return torch.where(keep, d / torch.sqrt(var + eps) * scale + bias, 0.0)
