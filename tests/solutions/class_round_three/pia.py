"""Correct: mul and add methods, torch.zeros_like as the padding's value."""

import torch


def masked_layer_normalization(
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-05,
) -> torch.Tensor:
    keep = valid[..., None]
    x0 = torch.where(keep, x, torch.zeros_like(x))
    mu = x0.mean(-1, keepdim=True)
    centred = x0.sub(mu)
    sigma2 = centred.mul(centred).mean(-1, keepdim=True)
    normed = centred.div(sigma2.add(eps).sqrt())
    out = normed.mul(scale).add(bias)
    return torch.where(keep, out, torch.zeros_like(out))
