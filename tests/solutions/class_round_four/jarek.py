import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """Returns (out, mean, rstd) as torch.native_layer_norm does."""
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(keep, y, 0.0), mean, torch.rsqrt(var + eps)
