import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """|d| as maximum(d, -d) before squaring: its gradient at a tie is half of each side."""
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    d = xc - mean
    var = torch.maximum(d, -d).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(keep, y, 0.0)
