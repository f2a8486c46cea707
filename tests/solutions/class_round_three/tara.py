"""Wrong: torch.var's unbiased variance rescaled by (C - 1) / C: NaN at C = 1."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    n = x.shape[-1]
    var = torch.var(xc, dim=-1, keepdim=True) * (n - 1) / n
    mean = xc.mean(-1, keepdim=True)
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)
