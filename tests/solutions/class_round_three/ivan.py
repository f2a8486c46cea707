"""Correct: Welford's running mean and M2 over the channels, vectorized over rows."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid[..., None]
    xc = torch.where(keep, x, 0.0)
    mean = torch.zeros_like(xc[..., :1])
    m2 = torch.zeros_like(mean)
    for i in range(xc.shape[-1]):
        xi = xc[..., i : i + 1]
        delta = xi - mean
        mean = mean + delta / (i + 1)
        m2 = m2 + delta * (xi - mean)
    y = (xc - mean) / torch.sqrt(m2 / xc.shape[-1] + eps)
    return torch.where(keep, y * scale + bias, 0.0)
