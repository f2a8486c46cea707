import torch


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xc, scale, bias, eps):
        mean = xc.mean(-1, keepdim=True)
        rstd = torch.rsqrt((xc - mean).square().mean(-1, keepdim=True) + eps)
        xhat = (xc - mean) * rstd
        out = xhat * scale + bias
        ctx.save_for_backward(xhat, rstd, scale, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xhat, rstd, scale, _ = ctx.saved_tensors
        gs = grad_out * scale
        grad_x = rstd * (gs + gs.mean(-1, keepdim=True) - xhat * (gs * xhat).mean(-1, keepdim=True))
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad_scale = (rows * xhat.reshape(rows.shape)).sum(0)
        return grad_x, grad_scale, rows.sum(0), None


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """A hand-written backward with the mean term's sign flipped."""
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    return torch.where(keep, _Norm.apply(xc, scale, bias, eps), 0.0)
