"""Wrong: the output allocated with torch.empty_like and written at the valid rows only."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    rows = x.reshape(-1, x.shape[-1])
    ok = valid.reshape(-1)
    xr = rows[ok]
    mean = xr.mean(-1, keepdim=True)
    var = ((xr - mean) ** 2).mean(-1, keepdim=True)
    out = torch.empty_like(rows)
    out[ok] = (xr - mean) / torch.sqrt(var + eps) * scale + bias
    return out.reshape(x.shape)
