"""Correct: two passes, each a loop over the channels, as a kernel's loop would."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    C = x.shape[-1]
    s = torch.zeros_like(xc[..., :1])
    for c in range(C):
        s = s + xc[..., c : c + 1]
    mean = s / C
    d = xc - mean
    q = torch.zeros_like(s)
    for c in range(C):
        q = q + d[..., c : c + 1] ** 2
    y = d / torch.sqrt(q / C + eps) * scale + bias
    return torch.where(keep, y, 0.0)
