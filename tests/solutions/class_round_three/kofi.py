"""Correct: a custom autograd.Function whose backward is written in torch operations from the
inputs (so that it is differentiable twice)."""

import torch


def _forward(xc, scale, bias, eps):
    mean = xc.mean(-1, keepdim=True)
    d = xc - mean
    rstd = torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + eps)
    return d * rstd, rstd


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xc, scale, bias, eps):
        xhat, _ = _forward(xc, scale, bias, eps)
        ctx.save_for_backward(xc, scale)
        ctx.eps = eps
        return xhat * scale + bias

    @staticmethod
    def backward(ctx, g):
        xc, scale = ctx.saved_tensors
        xhat, rstd = _forward(xc, scale, None, ctx.eps)
        gs = g * scale
        dx = rstd * (gs - gs.mean(-1, keepdim=True) - xhat * (gs * xhat).mean(-1, keepdim=True))
        flat = g.reshape(-1, g.shape[-1])
        dscale = (flat * xhat.reshape(flat.shape)).sum(0)
        return dx, dscale, flat.sum(0), None


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    return torch.where(keep, _LayerNorm.apply(torch.where(keep, x, 0.0), scale, bias, eps), 0.0)
