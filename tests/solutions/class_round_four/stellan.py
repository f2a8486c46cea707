import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """The valid rows found with nonzero().squeeze(), their statistics over dim 1 of the matrix
    they make: one valid row squeezes to a vector, which has no dim 1."""
    c = x.shape[-1]
    rows = x.reshape(-1, c)
    index = valid.reshape(-1).nonzero().squeeze()
    chosen = rows[index]
    mean = chosen.mean(1, keepdim=True)
    var = (chosen - mean).square().mean(1, keepdim=True)
    y = (chosen - mean) / torch.sqrt(var + eps) * scale + bias
    out = torch.zeros(rows.shape, dtype=y.dtype).index_put((index,), y)
    return out.reshape(x.shape)
