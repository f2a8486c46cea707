"""Wrong: the mask ignored altogether (a plain layer norm)."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * scale + bias
