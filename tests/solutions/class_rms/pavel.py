"""Wrong: the gain taken one less than scale (Gemma's zero-centred weight read as an offset to
remove, scale - 1), where the exercise's gain is scale."""

import torch


def masked_rms_normalization(x, valid, scale, eps=1e-6):
    keep = valid.unsqueeze(-1)
    x = torch.where(keep, x, 0.0)
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (scale - 1.0)
    return torch.where(keep, y, 0.0)
