"""grad_scale and grad_bias summed over many rows in a half dtype: PyTorch's backward adds the
rows one by one in bfloat16, and such a sum errs per element by about ``u * sqrt(N)`` of its
terms' norm (0.16 of the element at 10,000 rows, with u = 2**-8), and shrinks as a whole
once its partial sums dwarf the terms (a term under half their spacing is lost, one towards 0
kept more often than one away from it): by -4 % at 30,000 rows, -19 % at 100,000, -45 % at
200,000; ones stop at 256. The sums' systematic test took these for a mistake (within a fifth
of the budget): "all 8 elements scaled by 1 - 0.087 ± 0.01" from 8 elements agreeing by
chance, "30 of 32 elements scaled by 0.55" from the shrinking (found by a hunt for false
FAILs: 1 of 216 draws at 8 channels, 1 of 2 at 200,000 rows). A sum's factor is now judged
against PyTorch's own sum's errors on the same rows, and a long sum's shrinking."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from maskln_cli.op.threads import one_thread
from tests import kernels


@pytest.fixture(autouse=True)
def _one_thread():
    """PyTorch's backward sums on each of its threads, then adds their sums: on one thread
    (as the suite's workers run) it is one sequential sum, the draws' false FAILs."""
    with one_thread():
        yield


def _rows(seed: int, rows: int, channels: int, mixed: bool, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, channels, generator=g)
    if mixed:  # an outlier channel; half the upstream gradients 1e-3
        x[:, :1] *= 20
    scale = (1 + 0.1 * torch.randn(channels, generator=g)).to(dtype)
    bias = torch.randn(channels, generator=g).to(dtype)
    grad_out = torch.randn(rows, channels, generator=g)
    if mixed:
        grad_out *= torch.where(torch.rand(rows, 1, generator=g) < 0.5, 1e-3, 1.0)
    valid = torch.rand(rows, generator=g) > (0.3 if mixed else 0.0)
    return x.to(dtype), valid, scale, bias, grad_out.to(dtype)


@pytest.mark.parametrize(
    "seed, rows, channels, mixed",
    [
        (5, 10_000, 8, False),  # grad_scale: 8 elements agreeing on -0.087 by chance
        (1, 50_000, 8, True),  # grad_bias: 35,000 valid rows, "scaled by 0.897"
        pytest.param(1, 200_000, 32, False, marks=pytest.mark.slow),  # grad_bias: -45 %
    ],
)
def test_pytorch_bfloat16_sums_over_many_rows_pass(seed, rows, channels, mixed):
    x, valid, scale, bias, grad_out = _rows(seed, rows, channels, mixed)
    report = kernels.verified(
        lambda *a: kernels.torch_layer_norm(*a[:4]), x, valid, scale, bias, kernels.EPS, grad_out
    )
    assert report.passed, [t.problems for t in report.tensors if not t.passed]


@pytest.mark.parametrize("rows", [300, 2_000, 10_000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_pytorch_sums_of_an_upstream_gradient_of_ones_pass(dtype, rows):
    """``out.sum().backward()``: PyTorch's bfloat16 grad_bias, ones added one by one, stops at
    256 (the sum where adding 1 rounds back), 0.13 of the truth at 2,000 rows; float16's at
    2,048. Within its budget (PyTorch's own error raises it), and no mistake of the kernel's:
    "all 16 elements scaled by 0.128" failed it."""
    x, valid, scale, bias, _ = _rows(0, rows, 16, False, dtype)
    grad_out = torch.ones(rows, 16, dtype=dtype)
    report = kernels.verified(
        lambda *a: kernels.torch_layer_norm(*a[:4]), x, valid, scale, bias, kernels.EPS, grad_out
    )
    assert report.passed, [t.problems for t in report.tensors if not t.passed]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "tensor, factor, dtype, rows, channels",
    [
        ("grad_scale", 0.9, torch.bfloat16, 2_000, 16),
        ("grad_bias", 1.1, torch.bfloat16, 2_000, 16),
        ("grad_scale", 0.95, torch.bfloat16, 2_000, 64),
        ("grad_bias", 1.05, torch.bfloat16, 5_000, 64),
        ("grad_scale", 1.05, torch.bfloat16, 10_000, 16),
        ("grad_bias", 1.02, torch.float16, 10_000, 16),
    ],
    ids=str,
)
def test_a_sum_off_beyond_pytorchs_own_error_fails(tensor, factor, dtype, rows, channels, seed):
    """A factor several times what PyTorch's own sums err by on the same rows (bfloat16 over
    2,000 rows of 8: 1.8 % off): a floor modelled on the sums' error bound let 2 % to 30 %
    pass over 800 to 50,000 rows, where 83bd2d5 failed them (found by a hunt)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, channels, generator=g, dtype=torch.float64)
    valid = torch.rand(rows, generator=g) > 0.3
    x = torch.where(valid[:, None], x, 50 * torch.randn(rows, channels, generator=g))
    scale = 1 + 0.2 * torch.randn(channels, generator=g, dtype=torch.float64)
    bias = 0.5 * torch.randn(channels, generator=g, dtype=torch.float64)
    grad_out = torch.randn(rows, channels, generator=g, dtype=torch.float64)
    x, scale, bias, grad_out = (t.to(dtype) for t in (x, scale, bias, grad_out))
    report = kernels.verified(
        _scaled_gradient_kernel(tensor, factor), x, valid, scale, bias, kernels.EPS, grad_out
    )
    judged = {t.name: t for t in report.tensors}[tensor]
    assert not judged.passed, judged.to_dict()


def _scaled_gradient_kernel(tensor: str, factor: float):
    """Float32 inside (x cast up, F.layer_norm, cast back), the gradient of ``tensor`` scaled
    by ``factor``: its sums are float32's, so only the factor is off."""

    def kernel(x, valid, scale, bias, eps):
        if tensor == "grad_scale":
            scale = _ScaledGradient.apply(scale, factor)
        else:
            bias = _ScaledGradient.apply(bias, factor)
        rows = torch.where(valid[:, None], x, torch.zeros((), dtype=x.dtype)).float()
        out = F.layer_norm(rows, (x.shape[-1],), scale.float(), bias.float(), eps)
        return torch.where(valid[:, None], out, 0.0).to(x.dtype)

    return kernel


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tensor, factor", [("grad_scale", 1.05), ("grad_bias", 0.95)])
@pytest.mark.parametrize("dtype, rows", [(torch.float16, 2_000), (torch.bfloat16, 500)], ids=str)
def test_a_sum_five_percent_off_still_fails(dtype, rows, tensor, factor, seed):
    """Where the accumulation's rounding is a few percent of an element (float16 over 2,000
    rows: about 1 %; bfloat16 over 500: about 4 %), a factor of 5 % common to 64 elements is
    beyond it (over 2,000 bfloat16 rows PyTorch's own grad_scale is 5.5 % off: no test can
    tell such a factor there, and none is asked)."""
    x, valid, scale, bias, grad_out = _rows(seed, rows, 64, False, dtype)

    def kernel(x, valid, scale, bias, eps):
        if tensor == "grad_scale":
            scale = _ScaledGradient.apply(scale, factor)
        else:
            bias = _ScaledGradient.apply(bias, factor)
        return kernels.torch_layer_norm(x, valid, scale, bias)

    report = kernels.verified(kernel, x, valid, scale, bias, kernels.EPS, grad_out)
    judged = {t.name: t for t in report.tensors}[tensor]
    assert not judged.passed, judged.to_dict()


class _ScaledGradient(torch.autograd.Function):
    """A parameter unchanged, its gradient scaled by ``factor``."""

    @staticmethod
    def forward(ctx, parameter, factor):
        ctx.factor = factor
        return parameter.view_as(parameter)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None
