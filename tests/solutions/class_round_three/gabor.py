"""Wrong: a kernel whose backward reads the upstream gradient with .view (contiguous only)."""

import torch


class _Rows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xc, scale, bias, eps):
        c = xc.shape[-1]
        r = xc.reshape(-1, c)
        mean = r.mean(1, keepdim=True)
        rstd = torch.rsqrt((r - mean).pow(2).mean(1, keepdim=True) + eps)
        xhat = (r - mean) * rstd
        ctx.save_for_backward(xhat, rstd, scale)
        ctx.shape = xc.shape
        return (xhat * scale + bias).view(xc.shape)

    @staticmethod
    def backward(ctx, g):
        xhat, rstd, scale = ctx.saved_tensors
        g = g.view(xhat.shape)
        gs = g * scale
        dx = rstd * (gs - gs.mean(1, keepdim=True) - xhat * (gs * xhat).mean(1, keepdim=True))
        return dx.view(ctx.shape), (g * xhat).sum(0), g.sum(0), None


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    return torch.where(keep, _Rows.apply(torch.where(keep, x, 0.0), scale, bias, eps), 0.0)
