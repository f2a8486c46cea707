"""Wrong: valid read as a key_padding_mask (True = padding)."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    pad = valid.unsqueeze(-1)  # True marks padding, as in nn.MultiheadAttention
    xc = x.masked_fill(pad, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).pow(2).mean(-1, keepdim=True)
    return ((xc - mean) / torch.sqrt(var + eps) * scale + bias).masked_fill(pad, 0.0)
