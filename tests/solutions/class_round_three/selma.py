"""Wrong: a "vectorized" sum over blocks of 8 channels that loses the last C % 8."""

import torch


def _sum(t):
    c = t.shape[-1]
    body = c - c % 8
    if body == 0:
        return t.sum(-1, keepdim=True)
    return t[..., :body].reshape(*t.shape[:-1], body // 8, 8).sum((-1, -2)).unsqueeze(-1)


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    n = x.shape[-1]
    mean = _sum(xc) / n
    d = xc - mean
    var = _sum(d * d) / n
    return torch.where(keep, d / torch.sqrt(var + eps) * scale + bias, 0.0)
