"""maskln_cli.testing.strategies for RMSNorm: ``rms_norm_inputs`` draws (x, valid, scale, eps)
without a bias, from RMSNorm's own hard families (magnitudes whose squares overflow or underflow
the dtype), on which the op stays within a few ulps of a float64 reference written here and a
naive float32 kernel's overflow is found."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, find, given, settings

from maskln_cli import masked_rms_normalization
from maskln_cli.testing.strategies import RMSNormInputs, RMSNormInputsWithGrad, rms_norm_inputs

RUNS = settings(
    max_examples=60, derandomize=True, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip


def float64_rms(x, valid, scale, eps):
    """RMSNorm in float64 by plain ops. Rows of a magnitude m above 1 are scaled by it first,
    so that no square overflows float64 (x / m / sqrt(mean((x/m)**2) + eps/m**2)); below 1 a
    square may underflow only where eps (at least 1e-12 in the draws) outweighs it."""
    rows = torch.where(valid[..., None], x.double(), 0.0)
    largest = rows.abs().amax(-1, keepdim=True).clamp_min(1.0)
    scaled = rows / largest
    denominator = torch.sqrt(scaled.square().mean(-1, keepdim=True) + eps / largest.square())
    return torch.where(valid[..., None], scaled / denominator * scale.double(), 0.0)


def test_draws_have_no_bias_and_finite_valid_rows():
    @RUNS
    @given(rms_norm_inputs([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
    def check(inputs):
        assert isinstance(inputs, RMSNormInputs) and inputs._fields == RMSNormInputs._fields
        assert inputs._fields == ("x", "valid", "scale", "eps")
        x, valid = inputs.x, inputs.valid
        assert valid.dtype == torch.bool and tuple(valid.shape) == tuple(x.shape[:-1])
        assert bool(x[valid].isfinite().all())
        assert inputs.scale.shape == (x.shape[-1],) and inputs.eps > 0

    check()


def test_the_op_is_within_a_few_ulps_of_float64_on_every_draw():
    @RUNS
    @given(rms_norm_inputs([torch.float32, torch.float64], grad_out=True))
    def check(inputs):
        assert isinstance(inputs, RMSNormInputsWithGrad)
        x, valid, scale, eps, _ = inputs
        out = masked_rms_normalization(x, valid, scale, eps)
        truth = float64_rms(x, valid, scale, eps)
        ulp = torch.finfo(x.dtype).eps
        # A few ulps of each element, floored at the row's largest output (cancellation-free:
        # each output is one product of x, rstd and scale).
        floor = truth.abs().amax(-1, keepdim=True) * ulp
        assert bool(((out.double() - truth).abs() <= 8 * ulp * truth.abs() + 8 * floor).all())
        assert bool((out[~valid] == 0).all())

    check()


def test_rows_whose_squares_overflow_float32_are_drawn_and_break_a_naive_kernel():
    def naive(x, valid, scale, eps):
        """WRONG: mean(x**2) in float32 overflows for |x| above about 1.8e19."""
        rows = torch.where(valid[..., None], x, 0)
        out = rows * torch.rsqrt(rows.square().mean(-1, keepdim=True) + eps) * scale
        return torch.where(valid[..., None], out, 0)

    def broken(inputs):
        x, valid, scale, eps = inputs
        out = naive(x, valid, scale, eps).double()
        truth = float64_rms(x, valid, scale, eps)
        return not bool(torch.isclose(out, truth, rtol=1e-4, atol=1e-6).all())

    found = find(rms_norm_inputs([torch.float32], max_rows=4), broken, settings=RUNS)
    largest = float(found.x[found.valid].abs().max())
    assert largest > math.sqrt(torch.finfo(torch.float32).max) or largest < 1e-19
