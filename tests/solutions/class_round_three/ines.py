"""Wrong: mean and variance over the positions (dim=-2), as for a batch of vectors."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-2, keepdim=True)
    var = ((xc - mean) ** 2).mean(-2, keepdim=True)
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)
