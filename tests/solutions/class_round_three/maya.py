"""Wrong: the padding never sanitized; the output masked with torch.where (its gradients are
NaN where the padding holds NaN)."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(valid.unsqueeze(-1), y, 0.0)
