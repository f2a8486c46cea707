import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """eps at least the dtype's machine epsilon: float32's 1.2e-7 swallows a tiny eps."""
    eps = max(eps, torch.finfo(x.dtype).eps)
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(keep, y, 0.0)
