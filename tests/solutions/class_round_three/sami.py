"""Correct: the leading axes flattened by a view of a contiguous copy, x's layout kept at the
end with empty_like."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    c = x.shape[-1]
    flat = x.contiguous().view(-1, c)
    keep = valid.contiguous().view(-1, 1)
    flat = torch.where(keep, flat, 0.0)
    mean = flat.mean(1, keepdim=True)
    d = flat - mean
    y = d / torch.sqrt(d.pow(2).mean(1, keepdim=True) + eps) * scale + bias
    y = torch.where(keep, y, 0.0).view(x.shape)
    return torch.empty_like(x).copy_(y)
