"""Wrong: bias added before scaling, (xhat + bias) * scale."""

import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    var, mean = torch.var_mean(xc, dim=-1, keepdim=True, unbiased=False)
    y = ((xc - mean) / torch.sqrt(var + eps) + bias) * scale
    return torch.where(keep, y, 0.0)
