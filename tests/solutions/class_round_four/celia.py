import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """Rows in chunks of 128, concatenated."""
    c = x.shape[-1]
    rows, keep = x.reshape(-1, c), valid.reshape(-1, 1)
    parts = []
    for xs, ks in zip(rows.split(128), keep.split(128), strict=True):
        xc = xs.masked_fill(~ks, 0.0)
        mean = xc.sum(-1, keepdim=True) / c
        var = (xc - mean).pow(2).sum(-1, keepdim=True) / c
        parts.append(((xc - mean) / (var + eps).sqrt() * scale + bias).masked_fill(~ks, 0.0))
    if not parts:
        return torch.zeros(x.shape, dtype=torch.result_type(x, scale)) + 0.0 * bias
    return torch.cat(parts).reshape(x.shape)
