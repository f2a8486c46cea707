"""Wrong solutions that passed every mode of maskln grade while its clauses drew only random rows
(issue 32, item 1): each is right on random data and wrong on one family of data that random
data never makes, written three ways each, as students write them:

- valid rows that are constant (zero variance): the gradient w.r.t. x is lost there;
- valid rows holding exact zeros: the zeros are taken for padding;
- eps across its range: eps floored, or the denominator clamped, "for stability";
- C = 1: the second derivative (or the first) is NaN where the variance is zero by construction;
- non-contiguous, transposed or expanded upstream gradients: a backward that assumes its
  incoming gradient is contiguous.
"""

import math

import numpy as np
import torch


def _keep(valid):
    return valid.unsqueeze(-1)


def _statistics(xc):
    mean = xc.mean(dim=-1, keepdim=True)
    centered = xc - mean
    return centered, (centered * centered).mean(dim=-1, keepdim=True)


# constant rows: grad_x lost where the variance is zero --------------------------------------------


def constant_rows_where_zero(x, valid, scale, bias, eps=1e-05):
    """ "A constant row is already normalized": zero it with torch.where to skip dividing a zero
    variance. The values are right; the gradient through the zeros branch is 0."""
    keep = _keep(valid)
    centered, var = _statistics(torch.where(keep, x, 0.0))
    xhat = torch.where(var > 0, centered / torch.sqrt(var + eps), torch.zeros_like(centered))
    return torch.where(keep, xhat * scale + bias, 0.0)


class _GuardedNorm(torch.autograd.Function):
    """A hand-written backward that drops the gradient of rows whose variance is (nearly) zero,
    "to avoid blowing up"."""

    @staticmethod
    def forward(ctx, xc, eps):
        centered, var = _statistics(xc)
        rstd = torch.rsqrt(var + eps)
        xhat = centered * rstd
        ctx.save_for_backward(xhat, rstd, var)
        return xhat

    @staticmethod
    def backward(ctx, grad):
        xhat, rstd, var = ctx.saved_tensors
        mean_grad = grad.mean(-1, keepdim=True)
        mean_proj = (grad * xhat).mean(-1, keepdim=True)
        dx = rstd * (grad - mean_grad - xhat * mean_proj)
        return torch.where(var > 1e-12, dx, torch.zeros_like(dx)), None


def constant_rows_guarded_backward(x, valid, scale, bias, eps=1e-05):
    keep = _keep(valid)
    xhat = _GuardedNorm.apply(x.masked_fill(~keep, 0.0), eps)
    return (xhat * scale + bias).masked_fill(~keep, 0.0)


def constant_rows_loop_skips(x, valid, scale, bias, eps=1e-05):
    """Statistics row by row; a row with nothing to normalize (all its entries equal) gets
    rstd 0 "instead of 1 / sqrt(eps)": its values are right (x - mean is 0), its gradient 0."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    channels = x.shape[-1]
    means, rstds = [], []
    for row in xc.reshape(-1, channels):
        mean = row.mean()
        if bool((row == row[0]).all()):
            rstd = torch.zeros((), dtype=x.dtype, device=x.device)
        else:
            rstd = torch.rsqrt(((row - mean) ** 2).mean() + eps)
        means.append(mean)
        rstds.append(rstd)
    if not means:
        return torch.where(keep, xc * 0.0 + bias, 0.0)
    shape = (*xc.shape[:-1], 1)
    mean = torch.stack(means).reshape(shape)
    rstd = torch.stack(rstds).reshape(shape)
    return torch.where(keep, (xc - mean) * rstd * scale + bias, 0.0)


# exact zeros in valid rows: zeros taken for padding ----------------------------------------------


def zeros_counted_out_ne(x, valid, scale, bias, eps=1e-05):
    """Statistics over the nonzero entries: "zeros are padding inside the row"."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    present = (xc != 0).to(x.dtype)
    count = present.sum(-1, keepdim=True).clamp_min(1)
    mean = xc.sum(-1, keepdim=True) / count
    var = ((xc - mean) ** 2 * present).sum(-1, keepdim=True) / count
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)


def zeros_counted_out_count_nonzero(x, valid, scale, bias, eps=1e-05):
    """The row length taken as torch.count_nonzero."""
    keep = _keep(valid)
    xc = x.masked_fill(~keep, 0.0)
    length = torch.count_nonzero(xc, dim=-1).unsqueeze(-1).clamp_min(1)
    mean = xc.sum(-1, keepdim=True) / length
    centered = xc - mean
    var = (centered * centered).sum(-1, keepdim=True) / length
    return (centered / torch.sqrt(var + eps) * scale + bias).masked_fill(~keep, 0.0)


def zeros_counted_out_loop(x, valid, scale, bias, eps=1e-05):
    """Row by row, the statistics of row[row != 0]."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    channels = x.shape[-1]
    means, variances = [], []
    for row in xc.reshape(-1, channels):
        entries = row[row != 0]
        if entries.numel() == 0:
            entries = row
        var, mean = torch.var_mean(entries, correction=0)
        means.append(mean)
        variances.append(var)
    if not means:
        return torch.where(keep, xc * 0.0 + bias, 0.0)
    shape = (*xc.shape[:-1], 1)
    mean = torch.stack(means).reshape(shape)
    var = torch.stack(variances).reshape(shape)
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)


# eps across its range: floored or clamped ---------------------------------------------------------


def eps_floored(x, valid, scale, bias, eps=1e-05):
    """eps below 1e-5 "is numerically unsafe": floored."""
    eps = max(eps, 1e-5)
    keep = _keep(valid)
    centered, var = _statistics(torch.where(keep, x, 0.0))
    return torch.where(keep, centered / torch.sqrt(var + eps) * scale + bias, 0.0)


def rstd_clamped(x, valid, scale, bias, eps=1e-05):
    """The reciprocal standard deviation clamped "against overflow"."""
    keep = _keep(valid)
    centered, var = _statistics(x.masked_fill(~keep, 0.0))
    rstd = torch.rsqrt(var + eps).clamp(max=1e3)
    return (centered * rstd * scale + bias).masked_fill(~keep, 0.0)


def denominator_clamped(x, valid, scale, bias, eps=1e-05):
    """var + eps clamped from below before the square root."""
    keep = _keep(valid)
    centered, var = _statistics(torch.where(keep, x, 0.0))
    denominator = torch.sqrt(torch.clamp(var + eps, min=1e-6))
    return torch.where(keep, centered / denominator * scale + bias, 0.0)


# C = 1: the second derivative through a norm of a zero vector -------------------------------------


def std_from_vector_norm(x, valid, scale, bias, eps=1e-05):
    """The standard deviation as ||x - mean|| / sqrt(C): first derivatives right, the second NaN
    where x - mean is identically zero (C = 1)."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    centered = xc - xc.mean(-1, keepdim=True)
    std = torch.linalg.vector_norm(centered, dim=-1, keepdim=True) / math.sqrt(x.shape[-1])
    return torch.where(keep, centered / torch.sqrt(std * std + eps) * scale + bias, 0.0)


def variance_from_norm_squared(x, valid, scale, bias, eps=1e-05):
    """The variance as centered.norm() ** 2 / C."""
    keep = _keep(valid)
    xc = x.masked_fill(~keep, 0.0)
    centered = xc - xc.mean(-1, keepdim=True)
    var = centered.norm(dim=-1, keepdim=True) ** 2 / x.shape[-1]
    return (centered * torch.rsqrt(var + eps) * scale + bias).masked_fill(~keep, 0.0)


def variance_from_pairwise_distance(x, valid, scale, bias, eps=1e-05):
    """The variance as the squared distance from the row to its mean, over C."""
    keep = _keep(valid)
    xc = x.masked_fill(~keep, 0.0)
    mean = xc.mean(-1, keepdim=True)
    distance = torch.nn.functional.pairwise_distance(xc, mean.expand_as(xc), eps=0.0, keepdim=True)
    var = distance * distance / x.shape[-1]
    return ((xc - mean) / torch.sqrt(var + eps) * scale + bias).masked_fill(~keep, 0.0)


def std_by_hypot(x, valid, scale, bias, eps=1e-05):
    """sqrt(var + eps) as hypot(std, sqrt(eps)): the first derivative of std = sqrt(var) is
    NaN at var = 0, which C = 1 always has."""
    keep = _keep(valid)
    centered, var = _statistics(torch.where(keep, x, 0.0))
    root_eps = torch.tensor(math.sqrt(eps), dtype=x.dtype, device=x.device)
    return torch.where(keep, centered / torch.hypot(var.sqrt(), root_eps) * scale + bias, 0.0)


# the upstream gradient's layout: a backward that assumes it contiguous ------------------------


class _RowsKernel(torch.autograd.Function):
    """A kernel author's layer norm over rows [R, C], forward and backward by hand; ``read``
    is how the backward reads its incoming gradient as rows."""

    @staticmethod
    def forward(ctx, xc, scale, bias, eps, read):
        channels = xc.shape[-1]
        rows = xc.reshape(-1, channels)
        mean = rows.mean(-1, keepdim=True)
        rstd = torch.rsqrt((rows - mean).square().mean(-1, keepdim=True) + eps)
        xhat = (rows - mean) * rstd
        ctx.save_for_backward(xhat, rstd, scale)
        ctx.shape, ctx.read = xc.shape, read
        return (xhat * scale + bias).reshape(xc.shape)

    @staticmethod
    def backward(ctx, grad_out):
        xhat, rstd, scale = ctx.saved_tensors
        grad = ctx.read(grad_out, xhat.shape)
        dxhat = grad * scale
        dx = rstd * (
            dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True)
        )
        return dx.reshape(ctx.shape), (grad * xhat).sum(0), grad.sum(0), None, None


def _rows_kernel(read):
    def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
        keep = _keep(valid)
        out = _RowsKernel.apply(torch.where(keep, x, 0.0), scale, bias, eps, read)
        return torch.where(keep, out, 0.0)

    return masked_layer_normalization


upstream_view = _rows_kernel(lambda grad_out, shape: grad_out.view(shape))
"""The backward reads grad_out with .view: it raises on a transposed upstream gradient."""

upstream_as_strided = _rows_kernel(
    lambda grad_out, shape: grad_out.as_strided(shape, (shape[1], 1))
)
"""The backward reads grad_out's memory as contiguous rows (as_strided with row-major strides):
a transposed or expanded upstream gradient is read in the wrong order."""

upstream_numpy_buffer = _rows_kernel(
    lambda grad_out, shape: torch.from_numpy(
        np.ravel(grad_out.detach().numpy(), order="K").reshape(shape).copy()
    )
)
"""The backward hands grad_out to a NumPy kernel flattened in memory order (ravel(order="K"),
"no copy"): a transposed upstream gradient comes out scrambled."""
