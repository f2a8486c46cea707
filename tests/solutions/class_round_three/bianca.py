"""Wrong: a hand-written backward from xhat and rstd saved in the forward: right first
derivatives, wrong second ones."""

import torch


class _LN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xc, scale, bias, eps):
        mean = xc.mean(-1, keepdim=True)
        rstd = torch.rsqrt((xc - mean).pow(2).mean(-1, keepdim=True) + eps)
        xhat = (xc - mean) * rstd
        ctx.save_for_backward(xhat, rstd, scale)
        return xhat * scale + bias

    @staticmethod
    def backward(ctx, g):
        xhat, rstd, scale = ctx.saved_tensors
        gs = g * scale
        dx = rstd * (gs - gs.mean(-1, keepdim=True) - xhat * (gs * xhat).mean(-1, keepdim=True))
        rows = g.reshape(-1, g.shape[-1])
        return dx, (rows * xhat.reshape(rows.shape)).sum(0), rows.sum(0), None


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    return torch.where(keep, _LN.apply(torch.where(keep, x, 0.0), scale, bias, eps), 0.0)
