"""Wrong: without grad the result goes into a buffer kept per shape, reused by later calls."""

import torch

_buffers = {}


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = ((xc - mean) ** 2).mean(-1, keepdim=True)
    y = torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)
    if y.requires_grad:
        return y
    key = (tuple(y.shape), y.dtype)
    if key not in _buffers:
        _buffers[key] = torch.empty_like(y)
    return _buffers[key].copy_(y)
