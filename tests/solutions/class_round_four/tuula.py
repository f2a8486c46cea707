import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """The affine skipped when it is the identity (as initialized): scale and bias get no
    gradient."""
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps)
    if not (bool((scale == 1).all()) and bool((bias == 0).all())):
        y = y * scale + bias
    return torch.where(keep, y, 0.0)
