"""Correct implementations written differently from tests/solutions/correct.py, as people
write them: each passes every required clause, at any seed. Their float32 accuracy on rows
with a large offset differs (the accuracy clauses compare RMS errors with F.layer_norm's):
a Welford loop and a channel-by-channel sum err about 2.5 times as much as F.layer_norm, so
they pass two_pass (4x) and fail the strict offset_accuracy (2x)."""

import torch


def _keep(valid):
    return valid.unsqueeze(-1)


def welford(x, valid, scale, bias, eps=1e-05):
    """Welford's online mean and variance over the channels, vectorized over rows."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    mean = torch.zeros_like(xc[..., :1])
    m2 = torch.zeros_like(xc[..., :1])
    for i in range(x.shape[-1]):
        xi = xc[..., i : i + 1]
        delta = xi - mean
        mean = mean + delta / (i + 1)
        m2 = m2 + delta * (xi - mean)
    y = (xc - mean) / torch.sqrt(m2 / x.shape[-1] + eps) * scale + bias
    return torch.empty_like(x).copy_(torch.where(keep, y, 0.0))


def var_mean(x, valid, scale, bias, eps=1e-05):
    """torch.var_mean with correction=0."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    variance, mean = torch.var_mean(xc, dim=-1, keepdim=True, correction=0)
    y = (xc - mean) * torch.rsqrt(variance + eps) * scale + bias
    return torch.empty_like(x).copy_(torch.where(keep, y, 0.0))


def float64_inside(x, valid, scale, bias, eps=1e-05):
    """Computes in float64 and returns x's dtype."""
    keep = _keep(valid)
    xd = torch.where(keep, x, 0.0).double()
    mean = xd.mean(-1, keepdim=True)
    variance = (xd - mean).square().mean(-1, keepdim=True)
    y = (xd - mean) / torch.sqrt(variance + eps) * scale.double() + bias.double()
    return torch.empty_like(x).copy_(torch.where(keep, y, 0.0))


def matmul_means(x, valid, scale, bias, eps=1e-05):
    """Row means as a product with a column of 1/C."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    column = torch.full((x.shape[-1], 1), 1.0 / x.shape[-1], dtype=x.dtype, device=x.device)
    centered = xc - xc @ column
    y = centered / torch.sqrt((centered * centered) @ column + eps) * scale + bias
    return torch.empty_like(x).copy_(torch.where(keep, y, 0.0))


def channel_loop(x, valid, scale, bias, eps=1e-05):
    """Two passes, each summing the channels one after another, as a simple kernel's loop."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    total = torch.zeros_like(xc[..., :1])
    for c in range(x.shape[-1]):
        total = total + xc[..., c : c + 1]
    centered = xc - total / x.shape[-1]
    squares = torch.zeros_like(total)
    for c in range(x.shape[-1]):
        squares = squares + centered[..., c : c + 1] * centered[..., c : c + 1]
    y = centered / torch.sqrt(squares / x.shape[-1] + eps) * scale + bias
    return torch.empty_like(x).copy_(torch.where(keep, y, 0.0))
