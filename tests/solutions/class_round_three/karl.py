"""Wrong: a hook on x zeroes the padding's gradient, and stays on the caller's x."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    if x.requires_grad:
        x.register_hook(lambda g: torch.where(keep, g, 0.0) if g is not None else g)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = ((xc - mean) ** 2).mean(-1, keepdim=True)
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)
