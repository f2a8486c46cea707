"""Correct: torch.var_mean with correction=0 and rsqrt; addcmul for the affine part."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    m = valid.unsqueeze(-1)
    clean = torch.where(m, x, 0.0)
    var, mean = torch.var_mean(clean, dim=-1, keepdim=True, correction=0)
    xhat = (clean - mean) * torch.rsqrt(var + eps)
    return torch.where(m, torch.addcmul(bias, xhat, scale), 0.0)
