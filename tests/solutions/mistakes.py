"""The usual mistakes, written as learners write them: each is the correct solution with one
formula wrong, and grading names it (maskln_cli.op.mistakes holds the catalogue)."""

import torch


def _masked(y, valid):
    return torch.where(valid.unsqueeze(-1), y, 0.0)


def _clean(x, valid):
    return torch.where(valid.unsqueeze(-1), x, 0.0)


def unbiased_variance(x, valid, scale, bias, eps=1e-05):
    x = _clean(x, valid)
    mean = x.mean(dim=-1, keepdim=True)
    variance = x.var(dim=-1, keepdim=True)  # torch's default: unbiased (C - 1)
    return _masked((x - mean) / torch.sqrt(variance + eps) * scale + bias, valid)


def unbiased_variance_guarded(x, valid, scale, bias, eps=1e-05):
    """Divides by C - 1, guarded at C = 1 (where it is then right)."""
    x = _clean(x, valid)
    mean = x.mean(dim=-1, keepdim=True)
    variance = (x - mean).square().sum(dim=-1, keepdim=True) / max(x.shape[-1] - 1, 1)
    return _masked((x - mean) / torch.sqrt(variance + eps) * scale + bias, valid)


def eps_outside_sqrt(x, valid, scale, bias, eps=1e-05):
    x = _clean(x, valid)
    mean = x.mean(dim=-1, keepdim=True)
    std = x.std(dim=-1, keepdim=True, unbiased=False)
    return _masked((x - mean) / (std + eps) * scale + bias, valid)


def eps_missing(x, valid, scale, bias, eps=1e-05):
    x = _clean(x, valid)
    mean = x.mean(dim=-1, keepdim=True)
    std = x.std(dim=-1, keepdim=True, unbiased=False)
    return _masked((x - mean) / std * scale + bias, valid)


def sqrt_missing(x, valid, scale, bias, eps=1e-05):
    x = _clean(x, valid)
    mean = x.mean(dim=-1, keepdim=True)
    variance = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return _masked((x - mean) / (variance + eps) * scale + bias, valid)


def _normalized(x, valid, eps):
    x = _clean(x, valid)
    mean = x.mean(dim=-1, keepdim=True)
    variance = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(variance + eps)


def scale_missing(x, valid, scale, bias, eps=1e-05):
    return _masked(_normalized(x, valid, eps) + bias, valid)


def bias_missing(x, valid, scale, bias, eps=1e-05):
    return _masked(_normalized(x, valid, eps) * scale, valid)


def bias_before_scale(x, valid, scale, bias, eps=1e-05):
    return _masked((_normalized(x, valid, eps) + bias) * scale, valid)


def scale_bias_swapped(x, valid, scale, bias, eps=1e-05):
    return _masked(_normalized(x, valid, eps) * bias + scale, valid)


def wrong_axis(x, valid, scale, bias, eps=1e-05):
    x = _clean(x, valid)
    mean = x.mean(dim=-2, keepdim=True)  # over the positions, not the channels
    variance = ((x - mean) ** 2).mean(dim=-2, keepdim=True)
    return _masked((x - mean) / torch.sqrt(variance + eps) * scale + bias, valid)


def rms_norm(x, valid, scale, bias, eps=1e-05):
    x = _clean(x, valid)
    return _masked(x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * scale + bias, valid)


def padding_returns_bias(x, valid, scale, bias, eps=1e-05):
    return _normalized(x, valid, eps) * scale + bias  # padded rows normalize to 0: bias is left


def padding_not_masked(x, valid, scale, bias, eps=1e-05):
    mean = x.mean(dim=-1, keepdim=True)
    variance = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(variance + eps) * scale + bias


def mask_inverted(x, valid, scale, bias, eps=1e-05):
    padding = valid  # valid read as a padding mask (True = padding)
    return _masked(_normalized(x, ~padding, eps) * scale + bias, ~padding)
