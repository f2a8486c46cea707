"""The benchmark's RMSNorm contenders (figures 18 and 19) compute the same op: each against a
float64 reference of plain ops, padding rows exactly +0, gradients w.r.t. x and scale alike.
A timing ratio between contenders that compute different things would mean nothing."""

from __future__ import annotations

import pytest
import torch

from benchmarks.workloads import RMS_CONTENDERS, RMS_EPS, Case, make_inputs


def reference(x: torch.Tensor, valid: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x64, scale64 = x.double(), scale.double()
    rstd = torch.rsqrt(x64.square().mean(-1, keepdim=True) + RMS_EPS)
    return torch.where(valid[..., None], x64 * rstd * scale64, torch.zeros((), dtype=x64.dtype))


@pytest.mark.parametrize("name", sorted(RMS_CONTENDERS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rms_contender_matches_float64(name: str, dtype: str) -> None:
    inputs = make_inputs(Case((64, 96), dtype), requires_grad=True)
    out = RMS_CONTENDERS[name](inputs)
    expected = reference(inputs.x, inputs.valid, inputs.scale)
    tolerance = 1e-5 if dtype == "float32" else 1e-12
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
    assert torch.equal(out[~inputs.valid], torch.zeros_like(out[~inputs.valid]))

    grad_out = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, (inputs.x, inputs.scale), grad_out)
    x64 = inputs.x.detach().double().requires_grad_(True)
    scale64 = inputs.scale.detach().double().requires_grad_(True)
    expected_grads = torch.autograd.grad(
        reference(x64, inputs.valid, scale64), (x64, scale64), grad_out.double()
    )
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
