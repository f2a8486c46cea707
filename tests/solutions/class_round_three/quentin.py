"""Wrong: the expanded mask cached by shape "to save work": later calls with another mask of
that shape use the first one."""

import torch

_cache = {}


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    key = (tuple(valid.shape), str(x.device))
    if key not in _cache:
        _cache[key] = valid.unsqueeze(-1).clone()
    keep = _cache[key]
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = ((xc - mean) ** 2).mean(-1, keepdim=True)
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)
