"""Correct: flattened to 2-D rows, normalized, reshaped back."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    ok = valid.reshape(-1, 1)
    rows = rows.masked_fill(~ok, 0.0)
    mean = rows.sum(1, keepdim=True) / rows.shape[1]
    centered = rows - mean
    var = centered.pow(2).sum(1, keepdim=True) / rows.shape[1]
    out = centered / torch.sqrt(var + eps) * scale + bias
    out = out.masked_fill(~ok, 0.0)
    return out.reshape(shape)
