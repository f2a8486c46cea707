"""Correct: a hand loop over the rows (slow, but right), the gain applied to them all."""

import torch


def masked_rms_normalization(x, valid, scale, eps=1e-6):
    channels = x.shape[-1]
    keep = valid.unsqueeze(-1)
    clean = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
    rows = clean.reshape(-1, channels)
    flags = valid.reshape(-1).tolist()
    normalized = []
    for row, valid_row in zip(rows, flags, strict=True):
        if valid_row:
            total = (row * row).sum()
            normalized.append(row / torch.sqrt(total / channels + eps))
        else:
            normalized.append(row)  # the sanitized row: zeros
    xhat = torch.stack(normalized).reshape(x.shape) if normalized else clean
    return torch.where(keep, xhat * scale, 0.0)
