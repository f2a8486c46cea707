"""Correct, unusual: padding sanitized by nan_to_num and a multiplication by the mask, the
output zeroed by a multiplication and made +0.0 by adding 0.0."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    m = valid.unsqueeze(-1).to(x.dtype)
    xc = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0) * m
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).pow(2).mean(-1, keepdim=True)
    y = ((xc - mean) / torch.sqrt(var + eps) * scale + bias) * m
    return y + 0.0  # -0.0 + 0.0 is +0.0
