import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """The mean divided by C - 1 (the variance's correction put on the mean)."""
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.sum(-1, keepdim=True) / max(x.shape[-1] - 1, 1)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(keep, y, 0.0)
