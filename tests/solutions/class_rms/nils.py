"""Wrong: the mask read the other way round (valid taken for a padding mask): the padded rows
are normalized and the valid ones zeroed."""

import torch


def masked_rms_normalization(x, valid, scale, eps=1e-6):
    keep = ~valid.unsqueeze(-1)
    x = torch.where(keep, x, 0.0)
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * scale
    return torch.where(keep, y, 0.0)
