"""Kernels with the bugs GPU and CPU kernel authors write (issue 22's reviewer): each is right at
the small sizes and in the dtypes the specification's clauses used to try, and wrong at a
realistic size or in half precision. Each fails the clause named in its docstring.
"""

import torch

from tests.solutions.broken import _analytic_gradients, _Kernel
from tests.solutions.correct import masked_layer_normalization as correct

WARP = 32
BLOCK = 512
GRID_ROWS = 1024


class _WarpBackwardKernel(_Kernel):
    @staticmethod
    def backward(ctx, dy):
        x, valid, scale = ctx.saved_tensors
        if x.shape[-1] <= WARP:
            return _Kernel.backward(ctx, dy)

        def warp_mean(t):  # the mistake: one warp's lanes only, not a loop over the row
            return t[..., :WARP].sum(dim=-1, keepdim=True) / t.shape[-1]

        dx, dscale, dbias = _analytic_gradients(dy, x, valid, scale, ctx.eps, row_mean=warp_mean)
        return dx, None, dscale, dbias, None


def backward_wrong_past_a_warp(x, valid, scale, bias, eps=1e-05):
    """large_shapes: a backward whose row reductions cover one warp (32 channels): right for
    C <= 32, grad_x wrong beyond (an error of about 0.25 at C = 64)."""
    return _WarpBackwardKernel.apply(x, valid, scale, bias, eps)


def statistics_of_one_block(x, valid, scale, bias, eps=1e-05):
    """large_shapes: mean and variance from the first 512 channels (one thread block's tile):
    right for C <= 512."""
    keep = valid.unsqueeze(-1)
    xs = x.masked_fill(~keep, 0.0)
    tile = xs[..., :BLOCK]
    mean = tile.mean(dim=-1, keepdim=True)
    variance = (tile - mean).square().mean(dim=-1, keepdim=True)
    y = (xs - mean) / torch.sqrt(variance + eps) * scale + bias
    return torch.empty_like(x).copy_(y.masked_fill(~keep, 0.0))


def rows_past_the_grid_left_zero(x, valid, scale, bias, eps=1e-05):
    """large_shapes: a launch of 1024 row blocks and no loop over the rest: rows past the 1024th
    stay at the output buffer's initial zeros."""
    y = correct(x, valid, scale, bias, eps)
    launched = torch.arange(valid.numel()).reshape(valid.shape) < GRID_ROWS
    return torch.empty_like(x).copy_(y * launched.unsqueeze(-1))


def unbiased_in_half_precision(x, valid, scale, bias, eps=1e-05):
    """half_values (opt-in): float16 and bfloat16 inputs take a separate path, computed in
    float32 but with the unbiased variance (C - 1)."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return correct(x, valid, scale, bias, eps)
    keep = valid.unsqueeze(-1)
    xs = x.float().masked_fill(~keep, 0.0)
    y = (xs - xs.mean(-1, keepdim=True)) / torch.sqrt(xs.var(-1, keepdim=True) + eps)
    y = y * scale.float() + bias.float()
    return torch.empty_like(x).copy_(y.masked_fill(~keep, 0.0))


def correct_with_float32_accumulation(x, valid, scale, bias, eps=1e-05):
    """No mistake: half-precision inputs computed in float32, as kernels accumulate."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return correct(x, valid, scale, bias, eps)
    out = correct(x.float(), valid, scale.float(), bias.float(), eps)
    return torch.empty_like(x).copy_(out)


def half_arithmetic(x, valid, scale, bias, eps=1e-05):
    """No mistake a grader should fail: the correct solution, run on half inputs as it is (torch
    rounds each step to the half dtype, accumulating its sums in float32)."""
    return correct(x, valid, scale, bias, eps)


def welford_in_half_precision(x, valid, scale, bias, eps=1e-05):
    """half_values (opt-in): a Welford loop whose running mean and M2 stay in x's dtype: in
    float16 or bfloat16 they lose the row's statistics as C grows (no float32 accumulation)."""
    keep = valid.unsqueeze(-1)
    xs = x.masked_fill(~keep, 0.0)
    mean = torch.zeros_like(xs[..., :1])
    m2 = torch.zeros_like(mean)
    for i in range(x.shape[-1]):
        delta = xs[..., i : i + 1] - mean
        mean = mean + delta / (i + 1)
        m2 = m2 + delta * (xs[..., i : i + 1] - mean)
    y = (xs - mean) / torch.sqrt(m2 / x.shape[-1] + eps) * scale + bias
    return torch.empty_like(x).copy_(y.masked_fill(~keep, 0.0))
