"""Wrong: the mean is not subtracted (RMS normalization)."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    rms = torch.sqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return torch.where(keep, xc / rms * scale + bias, 0.0)
