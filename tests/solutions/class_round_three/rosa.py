"""Correct: the statistics in a helper; the padding zeroed by selecting zeros where padding."""

import torch


def _stats(t):
    mean = t.mean(-1, keepdim=True)
    return mean, (t - mean).square().mean(-1, keepdim=True)


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    padding = ~valid.unsqueeze(-1)
    t = torch.where(padding, 0.0, x)
    mean, var = _stats(t)
    y = (t - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(padding, 0.0, y)
