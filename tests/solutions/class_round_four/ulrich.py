import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """C > 1 'needs' centering; C = 1 is computed as x / sqrt(x^2 + eps) (no centering)."""
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True) if x.shape[-1] > 1 else torch.zeros_like(xc)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(keep, y, 0.0)
