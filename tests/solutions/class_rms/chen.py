"""Correct: pow(2).mean, torch.where for the padding."""

import torch


def masked_rms_normalization(x, valid, scale, eps=1e-6):
    keep = valid.unsqueeze(-1)
    safe = torch.where(keep, x, torch.zeros_like(x))
    rms = safe.pow(2).mean(dim=-1, keepdim=True).add(eps).sqrt()
    return torch.where(keep, safe / rms * scale, torch.zeros_like(x))
