"""Wrong: sums over the channels divided by the number of valid positions (a masked mean over
the sequence)."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    n = keep.sum().clamp(min=1)
    mean = xc.sum(-1, keepdim=True) / n
    var = ((xc - mean) ** 2).sum(-1, keepdim=True) / n
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)
