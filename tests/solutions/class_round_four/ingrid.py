import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """C = 2 special-cased: the two values are +-1 apart from the mean (eps forgotten)."""
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    if x.shape[-1] == 2:
        y = torch.sign(xc - mean) * scale + bias
        return torch.where(keep, y, 0.0)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(keep, y, 0.0)
