"""Wrong: the mean square accumulated in float16 ("it is only a statistic")."""

import torch


def masked_rms_normalization(x, valid, scale, eps=1e-6):
    keep = valid.unsqueeze(-1)
    x = torch.where(keep, x, 0.0)
    mean_square = x.half().pow(2).mean(-1, keepdim=True).to(x.dtype)
    y = x * torch.rsqrt(mean_square + eps) * scale
    return torch.where(keep, y, 0.0)
