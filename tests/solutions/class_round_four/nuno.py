import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """Every row valid: a fast path, with no masking and no eps needed 'since rows vary'."""
    keep = valid.unsqueeze(-1)
    if bool(valid.all()):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).square().mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var) * scale + bias
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(keep, y, 0.0)
