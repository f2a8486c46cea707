"""Correct, unusual: one row's function mapped over the rows with torch.func.vmap (and no
rows handled apart: vmap cannot map over none)."""

import torch
from torch.func import vmap


def _row(xr, ok, scale, bias, eps):
    xr = torch.where(ok, xr, torch.zeros_like(xr))
    mean = xr.mean()
    var = ((xr - mean) ** 2).mean()
    y = (xr - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(ok, y, torch.zeros_like(y))


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    rows = x.reshape(-1, x.shape[-1])
    oks = valid.reshape(-1)
    if rows.shape[0] == 0:  # vmap cannot map over no rows
        return x * 0.0
    out = vmap(_row, in_dims=(0, 0, None, None, None))(rows, oks, scale, bias, eps)
    return out.reshape(x.shape)
