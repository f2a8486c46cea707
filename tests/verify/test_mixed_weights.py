"""Half x with float32 scale and bias (a half model keeping its LayerNorm weights in float32):
PyTorch's own mixed-precision LayerNorm returns grad_scale and grad_bias as float32 tensors
holding x's dtype's values. They are judged in x's dtype, so that PyTorch's own op passes
(a hunt found verify and check_kernel failing it), while a wrong backward still fails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from maskln_cli.testing import check_kernel, verify

CASES = [(torch.bfloat16, 768, False), (torch.float16, 768, False), (torch.bfloat16, 256, True),
         (torch.float16, 4096, True)]  # fmt: skip
"""dtype, C, NaN in the padding."""


def plain_kernel(x, valid, scale, bias, eps):
    kept = torch.where(valid[..., None], x, torch.zeros((), dtype=x.dtype))
    out = F.layer_norm(kept, (x.shape[-1],), scale, bias, eps)
    return out.masked_fill(~valid[..., None], 0.0)


def inputs(dtype: torch.dtype, C: int, nan: bool):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 24, C, generator=g).to(dtype)
    if nan:
        x[:, 20:] = float("nan")  # padding
    valid = torch.ones(3, 24, dtype=torch.bool)
    valid[:, 20:] = False
    scale = 1 + 0.1 * torch.randn(C, generator=g)
    bias = 0.1 * torch.randn(C, generator=g)
    grad_out = torch.randn(3, 24, C, generator=g).to(dtype)
    return x, valid, scale, bias, grad_out


def gradients(kernel, x, valid, scale, bias, grad_out):
    leaves = [t.clone().requires_grad_() for t in (x, scale, bias)]
    out = kernel(*leaves[:1], valid, *leaves[1:], 1e-5)
    grads = torch.autograd.grad(out, leaves, grad_out.masked_fill(~valid[..., None], 0.0))
    return out.detach(), *grads


@pytest.mark.parametrize(("dtype", "C", "nan"), CASES)
def test_pytorchs_own_mixed_layer_norm_passes(dtype, C, nan):
    x, valid, scale, bias, grad_out = inputs(dtype, C, nan)
    out, grad_x, grad_scale, grad_bias = gradients(plain_kernel, x, valid, scale, bias, grad_out)
    assert grad_scale.dtype == torch.float32
    report = verify(out, x, valid, scale, bias, 1e-5, grad_out=grad_out, grad_x=grad_x,
                    grad_scale=grad_scale, grad_bias=grad_bias, strict=False)  # fmt: skip
    assert report.passed, [t.problems for t in report.tensors if not t.passed]
    check_kernel(plain_kernel, x, valid, scale, bias, 1e-5, grad_out)


@pytest.mark.parametrize(("dtype", "C", "nan"), CASES)
def test_a_wrong_mixed_backward_still_fails(dtype, C, nan):
    """grad_bias scaled by scale (10% off on average): far beyond x's dtype's rounding."""
    x, valid, scale, bias, grad_out = inputs(dtype, C, nan)
    out, grad_x, grad_scale, grad_bias = gradients(plain_kernel, x, valid, scale, bias, grad_out)
    report = verify(out, x, valid, scale, bias, 1e-5, grad_out=grad_out, grad_x=grad_x,
                    grad_scale=grad_scale, grad_bias=grad_bias * scale, strict=False)  # fmt: skip
    failed = [t.name for t in report.tensors if not t.passed]
    assert failed == ["grad_bias"], failed
