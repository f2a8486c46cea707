"""Wrong: eps defaults to 1e-6 in the signature (BERT-style)."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-06):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = ((xc - mean) ** 2).mean(-1, keepdim=True)
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)
