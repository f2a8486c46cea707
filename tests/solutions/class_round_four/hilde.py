import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """Differences from the mean as a matrix product with the centering matrix."""
    c = x.shape[-1]
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    center = torch.eye(c, dtype=x.dtype) - torch.full((c, c), 1.0 / c, dtype=x.dtype)
    d = xc @ center
    var = (d * d).mean(-1, keepdim=True)
    return torch.where(keep, d / torch.sqrt(var + eps) * scale + bias, 0.0)
