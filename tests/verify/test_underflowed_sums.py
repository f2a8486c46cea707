"""A float16 grad_scale whose truth is below half float16's smallest subnormal (3e-8) rounds to
0 in every correct kernel, PyTorch's included: the elements of a sum whose stored rounding is
most of them say nothing of a factor. Correct kernels were failed "grad_scale: 14 of 16
elements scaled by 0 ± 0: systematic, not rounding" (x ~ 1e-4 N(0, 1) at eps 1e-2, grad_out
1e-6: the truth about 1e-10), found by a hunt for false FAILs. A grad_scale of zeros where the
truth is representable still fails."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from maskln_cli import masked_layer_normalization
from maskln_cli.testing import check_kernel


def layer_norm_in_float32(x, valid, scale, bias, eps):
    y = F.layer_norm(x.float(), x.shape[-1:], scale.float(), bias.float(), eps)
    return y.to(x.dtype).masked_fill(~valid[..., None], 0)


def small_rows(rows, grad_size, seed, x_size=1e-4, eps=1e-2, channels=16):
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x = (x_size * draw(rows, channels)).half()
    scale, bias = (1 + 0.5 * draw(channels)).half(), (0.5 * draw(channels)).half()
    grad_out = (grad_size * draw(rows, channels)).half()
    return x, torch.ones(rows, dtype=torch.bool), scale, bias, eps, grad_out


KERNELS = {"F.layer_norm in float32": layer_norm_in_float32, "maskln": masked_layer_normalization}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize(("rows", "grad_size"), [(1, 1e-6), (4, 1e-6), (16, 1e-6), (1, 1e-5)])
@pytest.mark.parametrize("seed", range(3))
def test_correct_kernels_pass_where_grad_scale_underflows(kernel, rows, grad_size, seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_kernel(KERNELS[kernel], *small_rows(rows, grad_size, seed))


class _ZeroGradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scale):
        return scale.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(grad)


def test_a_zero_grad_scale_where_it_is_representable_still_fails():
    """x of unit size, grad_out 1e-4: the true grad_scale is about 1e-4 times sqrt(N) (float16
    holds it to 11 bits); zeros fail."""

    def wrong(x, valid, scale, bias, eps):
        return layer_norm_in_float32(x, valid, _ZeroGradScale.apply(scale), bias, eps)

    inputs = small_rows(16, 1e-4, 0, x_size=1.0, eps=1e-5, channels=64)
    with warnings.catch_warnings(), pytest.raises(AssertionError, match="grad_scale"):
        warnings.simplefilter("ignore")
        check_kernel(wrong, *inputs)
