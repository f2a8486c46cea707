"""Mistakes whose root cause maskln grade named wrongly or vaguely (issue 32, item 3), written as
students write them; each is right but for that one mistake.
"""

import torch


def _keep(valid):
    return valid.unsqueeze(-1)


def _finish(xc, mean, var, scale, bias, eps, keep):
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(keep, y, 0.0)


_MASKS: dict[tuple, torch.Tensor] = {}


def stale_mask_cache(x, valid, scale, bias, eps=1e-05):
    """The expanded mask cached by shape "to save an unsqueeze": a later call with another mask
    of the same shape uses the first call's."""
    key = tuple(valid.shape)
    if key not in _MASKS:
        _MASKS[key] = valid.unsqueeze(-1).clone()
    keep = _MASKS[key]
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    return _finish(xc, mean, (xc - mean).square().mean(-1, keepdim=True), scale, bias, eps, keep)


def inverted_mask(x, valid, scale, bias, eps=1e-05):
    """valid read as a padding mask (True = padding), as nn.MultiheadAttention's
    key_padding_mask is."""
    padding = valid.unsqueeze(-1)
    xc = x.masked_fill(padding, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return y.masked_fill(padding, 0.0)


def eps_squared(x, valid, scale, bias, eps=1e-05):
    """eps read as a standard deviation: added squared."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    return _finish(xc, mean, var, scale, bias, eps**2, keep)


def unbiased_rescaled(x, valid, scale, bias, eps=1e-05):
    """torch.var's unbiased variance rescaled by (C - 1) / C: right for C > 1, NaN at C = 1
    (x.var() divides by C - 1 = 0)."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    channels = x.shape[-1]
    var = xc.var(-1, keepdim=True) * (channels - 1) / channels
    return _finish(xc, xc.mean(-1, keepdim=True), var, scale, bias, eps, keep)


def mean_over_valid_rows(x, valid, scale, bias, eps=1e-05):
    """Sums over the channels divided by the number of valid positions, as a masked mean over
    a sequence is."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    count = valid.sum().clamp_min(1)
    mean = xc.sum(-1, keepdim=True) / count
    var = ((xc - mean) ** 2).sum(-1, keepdim=True) / count
    return _finish(xc, mean, var, scale, bias, eps, keep)


def mean_over_whole_tensor(x, valid, scale, bias, eps=1e-05):
    """One mean and variance for the whole batch (over every valid element), as batch norm."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    elements = x[valid] if valid.dim() else x[None][valid[None]]
    mean = elements.mean() if elements.numel() else xc.new_zeros(())
    var = ((elements - mean) ** 2).mean() if elements.numel() else xc.new_zeros(())
    return _finish(xc, mean, var, scale, bias, eps, keep)


def empty_like_output(x, valid, scale, bias, eps=1e-05):
    """The output allocated with torch.empty_like and written at the valid rows only."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    out = torch.empty_like(y)
    out[valid] = y[valid]
    return out


def eps_as_float32_tensor(x, valid, scale, bias, eps=1e-05):
    """eps held as a tensor of the default dtype (float32): its value rounded to float32."""
    eps_t = torch.tensor(eps)
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps_t) * scale + bias, 0.0)


def mask_not_unsqueezed(x, valid, scale, bias, eps=1e-05):
    """valid used without [..., None]: torch.where lines [B, N] up with [B, N, C] from the
    right, and raises (or, when N == C, masks the wrong axis)."""
    xc = torch.where(valid, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(valid, y, 0.0)


def float32_work_buffer(x, valid, scale, bias, eps=1e-05):
    """The output started as torch.zeros(x.shape), in the default dtype (float32): writing the
    float64 rows into it raises."""
    out = torch.zeros(x.shape, device=x.device)
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    out[valid] = y[valid]
    return out


class _OnceDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xc, scale, bias, eps):
        mean = xc.mean(-1, keepdim=True)
        rstd = torch.rsqrt((xc - mean).square().mean(-1, keepdim=True) + eps)
        xhat = (xc - mean) * rstd
        ctx.save_for_backward(xhat, rstd, scale)
        return xhat * scale + bias

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        xhat, rstd, scale = ctx.saved_tensors
        dxhat = grad * scale
        dx = rstd * (
            dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True)
        )
        rows = grad.reshape(-1, grad.shape[-1])
        return dx, (rows * xhat.reshape(rows.shape)).sum(0), rows.sum(0), None


def once_differentiable_backward(x, valid, scale, bias, eps=1e-05):
    keep = _keep(valid)
    return torch.where(keep, _OnceDifferentiable.apply(torch.where(keep, x, 0.0), scale, bias,
                                                       eps), 0.0)  # fmt: skip


class _SavedWithoutGrad(torch.autograd.Function):
    """The backward written in torch ops (so double backward runs through it), from values
    computed in the forward without grad: its own derivative w.r.t. x misses their terms."""

    @staticmethod
    def forward(ctx, xc, scale, bias, eps):
        mean = xc.mean(-1, keepdim=True)
        rstd = torch.rsqrt((xc - mean).square().mean(-1, keepdim=True) + eps)
        xhat = (xc - mean) * rstd
        ctx.save_for_backward(xhat, rstd, scale)
        return xhat * scale + bias

    @staticmethod
    def backward(ctx, grad):
        xhat, rstd, scale = ctx.saved_tensors
        dxhat = grad * scale
        dx = rstd * (
            dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True)
        )
        rows = grad.reshape(-1, grad.shape[-1])
        return dx, (rows * xhat.reshape(rows.shape)).sum(0), rows.sum(0), None


def backward_from_saved_values(x, valid, scale, bias, eps=1e-05):
    keep = _keep(valid)
    return torch.where(keep, _SavedWithoutGrad.apply(torch.where(keep, x, 0.0), scale, bias,
                                                     eps), 0.0)  # fmt: skip
