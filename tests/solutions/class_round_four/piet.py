import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """Elements equal to the mean set to 0 'to avoid 0/0': their gradient is cut."""
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    xhat = (xc - mean) / torch.sqrt(var + eps)
    xhat = torch.where(xc == mean, 0.0, xhat)
    return torch.where(keep, xhat * scale + bias, 0.0)
