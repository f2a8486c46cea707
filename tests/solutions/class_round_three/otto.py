"""Wrong: computes in float32 whatever the input ("faster")."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xf = torch.where(keep, x, 0.0).float()
    mean = xf.mean(-1, keepdim=True)
    var = ((xf - mean) ** 2).mean(-1, keepdim=True)
    y = (xf - mean) / torch.sqrt(var + eps) * scale.float() + bias.float()
    return torch.where(keep, y, 0.0).to(x.dtype)
