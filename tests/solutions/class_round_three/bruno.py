"""Wrong: eps added to the standard deviation, outside the square root."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    pad = ~valid[..., None]
    z = x.masked_fill(pad, 0.0)
    mu = z.mean(-1, keepdim=True)
    sd = torch.std(z, -1, keepdim=True, unbiased=False)
    return ((z - mu) / (sd + eps) * scale + bias).masked_fill(pad, 0.0)
