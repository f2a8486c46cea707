"""Wrong: mean and variance detached "to save memory": the gradient misses them."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    with torch.no_grad():
        mean = xc.mean(-1, keepdim=True)
        var = ((xc - mean) ** 2).mean(-1, keepdim=True)
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)
