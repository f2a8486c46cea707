import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """The channels shuffled before summing 'to spread rounding': the caller's random stream
    moves."""
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    order = torch.randperm(x.shape[-1])
    mean = xc[..., order].mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(keep, y, 0.0)
