import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """Anomaly detection on while computing, then set off: a caller that had it on loses it."""
    torch.autograd.set_detect_anomaly(True)
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    torch.autograd.set_detect_anomaly(False)
    return torch.where(keep, y, 0.0)
