import itertools

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """A loop over every position of the leading axes, each row written in place."""
    everywhere = torch.ones_like(x, dtype=torch.bool)
    zeros = x.masked_fill(everywhere, 0.0)
    out = torch.where(everywhere, 0.0, zeros * scale + bias)  # +0.0, x, scale and bias in the graph
    for index in itertools.product(*[range(n) for n in valid.shape]):
        if valid[index]:
            row = x[index]
            n = row.shape[0]
            mean = torch.sum(row) / n
            var = torch.sum((row - mean) * (row - mean)) / n
            out[index] = (row - mean) / torch.sqrt(var + eps) * scale + bias
    return out
