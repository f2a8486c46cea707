"""Correct: torch.where to sanitize and to zero, mean and population variance."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid[..., None]
    xs = torch.where(keep, x, torch.zeros_like(x))
    mu = xs.mean(dim=-1, keepdim=True)
    var = ((xs - mu) ** 2).mean(dim=-1, keepdim=True)
    y = (xs - mu) / torch.sqrt(var + eps)
    y = y * scale + bias
    return torch.where(keep, y, torch.zeros_like(y))
