import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """Deterministic algorithms on for the call, then set off: a caller that had them on loses
    them."""
    torch.use_deterministic_algorithms(True)
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    torch.use_deterministic_algorithms(False)
    return torch.where(keep, y, 0.0)
