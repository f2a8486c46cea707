import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """A scatter of the valid rows' results into zeros."""
    c = x.shape[-1]
    rows, keep = x.reshape(-1, c), valid.reshape(-1)
    chosen = rows[keep]
    mean = chosen.mean(-1, keepdim=True)
    var = (chosen - mean).square().mean(-1, keepdim=True)
    y = (chosen - mean) / torch.sqrt(var + eps) * scale + bias
    out = torch.zeros(rows.shape, dtype=y.dtype) + 0.0 * bias
    out = out.masked_scatter(keep[:, None].expand_as(rows), y)
    return out.reshape(x.shape)
