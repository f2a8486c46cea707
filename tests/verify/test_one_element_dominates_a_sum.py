"""A sum's element holding most of the regression's weight (truth squared) is no evidence of a
factor common to the elements, and is left out of their fit: on float16 rows with an outlier
channel (300 N(0, 1) + 100), that channel's grad_scale is 97 % of the weight, a cancelling sum
of terms of about 8, which PyTorch's own float16 backward rounds by about 2 u; its error alone
was called "61 of 64 elements scaled by 1 + 0.001 ± 3e-05: systematic" (within a tenth of the
budget) in 2 of 40 draws with float16 parameters, 5 of 40 with float32 ones (found by a hunt
for false FAILs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from maskln_cli.testing import verify


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("parameters", [torch.float16, torch.float32], ids=str)
def test_pytorch_on_rows_with_an_outlier_channel_passes(parameters, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 64, generator=g, dtype=torch.float64)
    x[:, 0] = x[:, 0] * 300 + 100
    x, grad_out = x.half(), torch.randn(24, 64, generator=g).half()
    scale = torch.randn(64, generator=g).to(parameters)
    bias = torch.randn(64, generator=g).to(parameters)
    valid = torch.rand(24, generator=g) >= 0.2
    leaves = [t.clone().requires_grad_() for t in (x, scale, bias)]
    rows = torch.where(valid[:, None], leaves[0], torch.zeros((), dtype=x.dtype))
    out = F.layer_norm(rows, (64,), leaves[1], leaves[2], 1e-5).to(x.dtype)
    out = torch.where(valid[:, None], out, torch.zeros((), dtype=x.dtype))
    grads = torch.autograd.grad(out, leaves, grad_out)
    report = verify(
        out.detach(), x, valid, scale, bias, 1e-5, grad_out=grad_out, grad_x=grads[0],
        grad_scale=grads[1], grad_bias=grads[2],
    )  # fmt: skip
    assert report.passed, [t.problems for t in report.tensors if not t.passed]


def test_pytorch_float16_sums_over_many_rows_with_an_outlier_channel_pass():
    """35,000 valid float16 rows of 8 channels, the first 20 times the others, half the upstream
    gradients 1e-3: PyTorch's grad_scale is a sequential float16 sum, off by -3 % to +4.5 % per
    channel (within a tenth of its budget), the outlier channel's +3.4 % most of the weight:
    "all 8 elements scaled by 1 + 0.033 ± 0.0006: systematic" (1 of 10 draws, this one)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50000, 8, generator=g)
    x[:, :1] *= 20
    x = x.half()
    scale, bias = torch.randn(8, generator=g).half(), torch.randn(8, generator=g).half()
    grad_out = torch.randn(50000, 8, generator=g)
    grad_out = (grad_out * torch.where(torch.rand(50000, 1, generator=g) < 0.5, 1e-3, 1.0)).half()
    valid = torch.rand(50000, generator=g) > 0.3
    leaves = [t.clone().requires_grad_() for t in (x, scale, bias)]
    rows = torch.where(valid[:, None], leaves[0], torch.zeros((), dtype=x.dtype))
    out = F.layer_norm(rows, (8,), leaves[1], leaves[2], 1e-5)
    out = torch.where(valid[:, None], out, torch.zeros((), dtype=x.dtype))
    grads = torch.autograd.grad(out, leaves, grad_out)
    report = verify(
        out.detach(), x, valid, scale, bias, 1e-5, grad_out=grad_out, grad_x=grads[0],
        grad_scale=grads[1], grad_bias=grads[2],
    )  # fmt: skip
    assert report.passed, [t.problems for t in report.tensors if not t.passed]
