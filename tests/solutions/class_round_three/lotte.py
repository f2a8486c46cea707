"""Wrong: torch's own layer_norm does the work (the exercise asks for raw operations)."""

import torch
import torch.nn.functional as F


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    y = F.layer_norm(torch.where(keep, x, 0.0), x.shape[-1:], scale, bias, eps)
    return torch.where(keep, y, 0.0)
