import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """Each row divided by its largest magnitude first, 'for stability': eps then weighs more."""
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    peak = xc.abs().amax(-1, keepdim=True)
    xc = xc / torch.where(peak > 0, peak, 1.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(keep, y, 0.0)
