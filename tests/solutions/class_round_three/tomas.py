"""Correct: the gradient flows through torch.where, the sums through torch.sum with dim=-1."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = torch.unsqueeze(valid, -1)
    z = torch.where(keep, x, torch.tensor(0.0, dtype=x.dtype, device=x.device))
    n = z.size(-1)
    mean = torch.sum(z, dim=-1, keepdim=True) / n
    var = torch.sum(torch.square(z - mean), dim=-1, keepdim=True) / n
    res = torch.div(z - mean, torch.sqrt(var + eps))
    res = res * scale + bias
    return torch.where(keep, res, torch.tensor(0.0, dtype=res.dtype, device=res.device))
