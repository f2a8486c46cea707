"""Wrong: sanitizes the caller's x in place."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    with torch.no_grad():
        x.masked_fill_(~keep, 0.0)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return torch.where(keep, (x - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)
