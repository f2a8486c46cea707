"""Wrong: the padding filled only after the arithmetic: the output is right, but NaN in a
padded row reaches grad_x (the gradient of masked_fill is 0 there, and 0 * NaN is NaN)."""

import torch


def masked_rms_normalization(x, valid, scale, eps=1e-6):
    padding = ~valid.unsqueeze(-1)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale
    return y.masked_fill(padding, 0.0)
