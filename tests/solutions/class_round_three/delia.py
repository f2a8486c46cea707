"""Wrong: zeros in a row taken for padding: the statistics over its nonzero entries."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    present = (xc != 0).to(x.dtype)
    n = present.sum(-1, keepdim=True).clamp(min=1)
    mean = xc.sum(-1, keepdim=True) / n
    var = (((xc - mean) * present) ** 2).sum(-1, keepdim=True) / n
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)
