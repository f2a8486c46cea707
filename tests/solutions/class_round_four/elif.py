import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """Statistics from torch.var_mean(correction=0) on sanitized rows."""
    keep = valid.unsqueeze(-1).expand_as(x)
    xc = torch.where(keep, x, torch.zeros((), dtype=x.dtype))
    var, mean = torch.var_mean(xc, dim=-1, keepdim=True, correction=0)
    xhat = (xc - mean) * (var + eps).rsqrt()
    return torch.where(keep, xhat * scale + bias, torch.zeros((), dtype=x.dtype))
