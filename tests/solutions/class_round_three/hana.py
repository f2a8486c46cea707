"""Correct: only the valid rows are gathered with boolean indexing, normalized, and put back
into zeros with index_put."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    v = valid.reshape(-1)
    rows = x.reshape(-1, x.shape[-1])
    picked = rows[v]
    mean = picked.mean(-1, keepdim=True)
    var = ((picked - mean) ** 2).mean(-1, keepdim=True)
    y = (picked - mean) / torch.sqrt(var + eps) * scale + bias
    out = torch.zeros(rows.shape, dtype=y.dtype, device=x.device)
    out = out.index_put((v,), y)
    return out.reshape(x.shape)
