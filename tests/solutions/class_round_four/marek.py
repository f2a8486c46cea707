import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """The variance around zero, not around the mean (the mean only subtracted above)."""
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = xc.square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(keep, y, 0.0)
