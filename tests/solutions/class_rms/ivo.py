"""Wrong: the padding zeroed by multiplying with the mask: NaN * 0 is NaN."""

import torch


def masked_rms_normalization(x, valid, scale, eps=1e-6):
    keep = valid.unsqueeze(-1).to(x.dtype)
    masked = x * keep
    y = x * torch.rsqrt(masked.pow(2).mean(-1, keepdim=True) + eps) * scale
    return y * keep
