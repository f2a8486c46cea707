"""Wrong: torch's ready-made F.rms_norm (the exercise asks for raw tensor operations)."""

import torch.nn.functional as F


def masked_rms_normalization(x, valid, scale, eps=1e-6):
    padding = ~valid.unsqueeze(-1)
    clean = x.masked_fill(padding, 0.0)
    return F.rms_norm(clean, clean.shape[-1:], scale, eps).masked_fill(padding, 0.0)
