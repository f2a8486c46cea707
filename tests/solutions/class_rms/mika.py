"""Wrong in one family: a row of zeros taken for padding, its rstd set to 0. The output is
right (0 either way), but the gradient w.r.t. x on that row is lost: it is
dy * scale / sqrt(eps), not 0."""

import torch


def masked_rms_normalization(x, valid, scale, eps=1e-6):
    keep = valid.unsqueeze(-1)
    x = torch.where(keep, x, 0.0)
    mean_square = x.pow(2).mean(-1, keepdim=True)
    rstd = torch.where(mean_square > 0, torch.rsqrt(mean_square + eps), 0.0)
    return torch.where(keep, x * rstd * scale, 0.0)
