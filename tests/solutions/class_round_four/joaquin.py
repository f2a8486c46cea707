import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """A row of zeros is 'empty': zeros out, where the output is bias."""
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    empty = (xc == 0).all(-1, keepdim=True)
    return torch.where(keep & ~empty, y, 0.0)
