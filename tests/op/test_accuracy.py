"""Accuracy on hard data: long rows, heavy tails, outliers, offsets, and every float64 magnitude.

float32 results are measured against float64 and compared with torch's own F.layer_norm on the
same data; float64 results against exact arithmetic (mpmath, 200 bits). Errors are in units of
float32's resolution (2**-23) times each element's magnitude, floored at its row's RMS: an ulp
of the element, where rounding happens, and never less than the row's scale.
"""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
import torch.nn.functional as F

from maskln_cli import masked_layer_normalization
from maskln_cli.op.reference import reference_masked_layer_norm

FLOAT32_UNIT = 2.0**-23


def hard_rows(kind: str, rows: int, channels: int, seed: int = 0) -> torch.Tensor:
    """float64 rows of a distribution that is hard on a float32 variance."""
    generator = torch.Generator().manual_seed(seed)
    shape = (rows, channels)
    if kind == "normal":
        return torch.randn(shape, generator=generator, dtype=torch.float64)
    if kind == "uniform":
        return torch.rand(shape, generator=generator, dtype=torch.float64)
    if kind == "lognormal":  # heavy right tail: e**N(0, 2)
        return torch.randn(shape, generator=generator, dtype=torch.float64).mul_(2).exp_()
    if kind == "cauchy":  # heavier still, both sides
        return torch.empty(shape, dtype=torch.float64).cauchy_(generator=generator)
    if kind == "sparse":  # 1% large values, the rest tiny
        x = 1e-3 * torch.randn(shape, generator=generator, dtype=torch.float64)
        spikes = torch.rand(shape, generator=generator) < 0.01
        return torch.where(spikes, 100 * torch.randn(shape, generator=generator), x)
    if kind == "onehot":
        x = torch.zeros(shape, dtype=torch.float64)
        x[:, 0] = 1.0
        return x
    if kind == "outlier":  # LLM-like activations: one channel far out
        x = torch.randn(shape, generator=generator, dtype=torch.float64)
        x[:, 7 % channels] = 3000.0
        return x
    if kind == "offset":  # a large common offset
        return 1e4 + 0.1 * torch.randn(shape, generator=generator, dtype=torch.float64)
    raise AssertionError(kind)


def float32_error(out: torch.Tensor, truth: torch.Tensor) -> float:
    """Largest error, in float32 ulps of each element (floored at its row's RMS)."""
    rms = truth.square().mean(dim=-1, keepdim=True).sqrt()
    unit = torch.maximum(truth.abs(), rms).clamp_min(1e-300) * FLOAT32_UNIT
    return float(((out.detach().double() - truth).abs() / unit).max())


def float32_errors(x64: torch.Tensor, grad_out: torch.Tensor | None = None):
    """(ours, F.layer_norm's) errors on x64 rounded to float32, forward (and dx with grad_out)."""
    channels = x64.shape[-1]
    x = x64.float()
    valid = torch.ones(x.shape[:-1], dtype=torch.bool)
    ones, zeros = torch.ones(channels), torch.zeros(channels)
    leaves = [x.clone().requires_grad_(), x.clone().requires_grad_(), x.double().requires_grad_()]
    ours = masked_layer_normalization(leaves[0], valid, ones, zeros)
    peer = F.layer_norm(leaves[1], (channels,))
    truth = F.layer_norm(leaves[2], (channels,))
    errors = [(float32_error(ours, truth.detach()), float32_error(peer, truth.detach()))]
    if grad_out is not None:
        grads = [torch.autograd.grad(y, leaf, grad_out.to(y.dtype))[0] for y, leaf in
                 zip((ours, peer, truth), leaves, strict=True)]  # fmt: skip
        errors.append((float32_error(grads[0], grads[2]), float32_error(grads[1], grads[2])))
    return errors


def within_twice_torch(ours: float, peer: float) -> bool:
    """ours <= 2x torch's error, or below one ulp of the element (where torch rounds luckily)."""
    return ours <= max(2 * peer, 1.0)


KINDS = ["normal", "uniform", "lognormal", "cauchy", "sparse", "onehot", "outlier", "offset"]


@pytest.mark.parametrize("channels", [128, 4096, 65536, 262144])
@pytest.mark.parametrize("kind", KINDS)
def test_float32_error_within_twice_torch_layer_norm(kind, channels):
    rows = max(2, min(64, 2**20 // channels))
    ((ours, peer),) = float32_errors(hard_rows(kind, rows, channels, seed=channels))
    assert within_twice_torch(ours, peer), (ours, peer)
    assert ours < 4.0, ours  # a few ulps at most, on every kind
    if kind == "offset":  # where the corrected two-pass wins by orders of magnitude
        assert ours * 100 < peer


@pytest.mark.parametrize("kind", ["normal", "uniform", "onehot", "lognormal"])
def test_float32_long_rows_values_and_gradients(kind):
    """2**22 channels: the long-row regime where a running sum of squares loses digits."""
    channels = 2**22
    x64 = hard_rows(kind, 2, channels, seed=3)
    grad_out = torch.randn(x64.shape, generator=torch.Generator().manual_seed(4))
    (values, grads) = float32_errors(x64, grad_out)
    assert within_twice_torch(*values), values
    assert within_twice_torch(*grads), grads


def test_one_hot_row_is_correctly_rounded():
    """x = [1, 0, ..., 0] with C = 8192: the true value is 87.00994239..., which rounds to
    87.009941 in float32; a running float32 sum of squares gave 87.010559."""
    x = torch.zeros(2, 8192)
    x[:, 0] = 1
    out = masked_layer_normalization(x, torch.ones(2, dtype=torch.bool), torch.ones(8192),
                                     torch.zeros(8192))  # fmt: skip
    exact = (1 - mpmath.mpf(1) / 8192) / mpmath.sqrt(mpmath.mpf(8191) / 8192**2 + mpmath.mpf(1e-5))
    float32_ulp = 2.0 ** (math.frexp(float(exact))[1] - 24)
    assert abs(out[0, 0].item() - float(exact)) <= float32_ulp  # 87.010559 was 81 ulps off


def test_outlier_channel_rows_pass_float32_default_tolerance():
    """N(0, 1) rows of 8192 channels with one channel at 3000 (as LLM activations have):
    every row within torch.testing's float32 tolerance of the float64 result (251 of 256 rows
    missed it before the sum of squares was fixed)."""
    x64 = hard_rows("outlier", 256, 8192, seed=1)
    x = x64.float()
    valid = torch.ones(256, dtype=torch.bool)
    out = masked_layer_normalization(x, valid, torch.ones(8192), torch.zeros(8192))
    truth = F.layer_norm(x.double(), (8192,))
    bad = ~torch.isclose(out.double(), truth, rtol=1.3e-6, atol=1e-5)
    assert int(bad.any(dim=-1).sum()) == 0


# --- float64: every finite magnitude, against exact arithmetic ---------------------------------

mpmath.mp.prec = 200


def exact_row(row: list[float], scale: list[float], bias: list[float], eps: float, dy: list[float]):
    """(y, dx, dscale) of one valid row, in 200-bit arithmetic, and the natural scale of each
    (the size of the terms it is made of, against which its rounding is measured)."""
    x = [mpmath.mpf(v) for v in row]
    channels = len(x)
    mean = sum(x) / channels
    var = sum((v - mean) ** 2 for v in x) / channels
    rstd = 1 / mpmath.sqrt(var + mpmath.mpf(eps))
    xhat = [(v - mean) * rstd for v in x]
    y = [h * s + b for h, s, b in zip(xhat, scale, bias, strict=True)]
    wdy = [mpmath.mpf(d) * s for d, s in zip(dy, scale, strict=True)]
    c1 = sum(h * w for h, w in zip(xhat, wdy, strict=True)) / channels
    c2 = sum(wdy) / channels
    dx = [rstd * (w - h * c1 - c2) for w, h in zip(wdy, xhat, strict=True)]
    dscale = [mpmath.mpf(d) * h for d, h in zip(dy, xhat, strict=True)]
    results = [[float(v) for v in values] for values in (y, dx, dscale)]
    scales = [
        max(abs(float(v)) for v in [*y, *bias]),
        float(rstd * max(abs(w) for w in wdy)),
        float(max(abs(mpmath.mpf(d)) for d in dy) * max(abs(h) for h in xhat)),
    ]
    return results, scales


HUGE_ROWS = {
    "1e160": [1e160, -1e160, 3e160, 0.0],
    "1e155": [1e155, -1e155],
    "3e200 with small values": [3e200, 1e200, -2e200, 5e199, 1.0, 2.0, 3.0, 4.0],
    "near the limit": [1.7e308, -1.7e308, 1e308, -5e307],
    "sum overflows": [1.7e308, 1.7e308, 1.6e308],
    "tiny": [1e-300, -3e-300, 2e-300, 0.0],
    "subnormal": [5e-324, -1e-323, 2e-323, 0.0],
    "mixed 1e-200 and 1": [1.0, 1e-200, -1.0, 0.5],
    "constant 1e200": [1e200] * 7,
    "constant near the limit": [1.7e308] * 5,
    "constant 0.1": [0.1] * 3,
}


@pytest.mark.parametrize("row", HUGE_ROWS.values(), ids=HUGE_ROWS.keys())
def test_float64_rows_of_any_magnitude_match_exact_arithmetic(row):
    """Rows of 1e154 and up once returned bias (their squares overflowed) or NaN."""
    assert_matches_exact_arithmetic(row, 1e-5)


TINY_VARIANCE_ROWS = {
    "1e-158, eps 1e-316": ([1e-158, -2e-158, 3e-158, 0.5e-158], 1e-316),
    "1e-160, eps 3e-320": ([1e-160, -1e-160, 2.5e-160], 3e-320),
    "3e-162, eps 1e-323": ([3e-162, 0.0, -3e-162, 1e-162, 2e-162], 1e-323),
    "1e-155 on an offset, eps 1e-310": ([1e-140 + k * 1e-155 for k in (1, -2, 3, 0)], 1e-310),
}


@pytest.mark.parametrize(("row", "eps"), TINY_VARIANCE_ROWS.values(), ids=TINY_VARIANCE_ROWS.keys())
def test_float64_rows_whose_squares_underflow_match_exact_arithmetic(row, eps):
    """Deviations of 1e-158 square to subnormal numbers: with an eps as tiny, the native kernel
    lost all precision (it rescued only rows whose squares overflowed)."""
    assert_matches_exact_arithmetic(row, eps)


def assert_matches_exact_arithmetic(row: list[float], eps: float) -> None:
    channels = len(row)
    generator = torch.Generator().manual_seed(channels)
    scale = (1 + torch.rand(channels, generator=generator, dtype=torch.float64)).tolist()
    bias = torch.randn(channels, generator=generator, dtype=torch.float64).tolist()
    dy = torch.randn(channels, generator=generator, dtype=torch.float64).tolist()
    (want_y, want_dx, want_dscale), scales = exact_row(row, scale, bias, eps, dy)
    # Row 0 is the row under test; row 1 an invalid copy, which must not change anything.
    x = torch.tensor([row, row], dtype=torch.float64)
    valid = torch.tensor([True, False])
    leaves = [x.clone().requires_grad_(), torch.tensor(scale, dtype=torch.float64),
              torch.tensor(bias, dtype=torch.float64)]  # fmt: skip
    leaves[1].requires_grad_()
    out = masked_layer_normalization(leaves[0], valid, leaves[1], leaves[2], eps)
    grad_out = torch.tensor([dy, dy], dtype=torch.float64)
    first = torch.autograd.grad(out, leaves[:2], grad_out, retain_graph=True)
    graph = torch.autograd.grad(out, leaves[:2], grad_out, create_graph=True)

    def close(got: torch.Tensor, want: list[float], natural_scale: float) -> bool:
        """Within 8 ulps of the natural scale; below the smallest normal number float64 has
        no relative precision left (a subnormal row's dscale is subnormal itself)."""
        allowed = max(8 * 2.0**-52 * natural_scale, torch.finfo(torch.float64).tiny)
        want_t = torch.tensor(want, dtype=torch.float64)
        return bool(((got - want_t).abs() <= allowed).all())

    assert close(out[0].detach(), want_y, scales[0]), (out[0].tolist(), want_y)
    assert torch.equal(out[1], torch.zeros(channels, dtype=torch.float64))
    for dx, dscale in (first, graph):
        assert close(dx[0].detach(), want_dx, scales[1]), (dx[0].tolist(), want_dx)
        assert close(dscale.detach(), want_dscale, scales[2]), (dscale.tolist(), want_dscale)
        assert torch.equal(dx[1].detach(), torch.zeros(channels, dtype=torch.float64))


@pytest.mark.parametrize("exponent", [0, 100, 400, 510, 600, 1000])
def test_float64_results_do_not_depend_on_a_power_of_two_scale_of_x(exponent):
    """With eps negligible, out(x * 2**k) == out(x) up to rounding: no magnitude is special.
    (Rows are never scaled up: below about 1e-150 the variance underflows, which matters only
    with an eps below about 1e-290.)"""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=generator, dtype=torch.float64)
    valid = torch.ones(16, dtype=torch.bool)
    scale, bias = torch.ones(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
    base = masked_layer_normalization(x, valid, scale, bias, 1e-300)
    scaled_x = torch.ldexp(x, torch.tensor(float(exponent), dtype=torch.float64))
    assert scaled_x.isfinite().all()
    scaled = masked_layer_normalization(scaled_x, valid, scale, bias, 1e-300)
    torch.testing.assert_close(scaled, base, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("shape", [(65536, 32), (4096, 768), (8, 2**17)])
def test_float32_parameter_gradients_within_twice_torch_layer_norm(shape):
    """grad_scale and grad_bias are sums over every row, up to 65,536 of them here: they must
    stay as accurate as torch's own (within 2x its error, or an ulp of the largest sum)."""
    rows, channels = shape
    generator = torch.Generator().manual_seed(rows)
    x = (1 + torch.randn(shape, generator=generator, dtype=torch.float64)).float()
    dy = torch.randn(shape, generator=generator, dtype=torch.float64).float()
    scale = (1 + 0.1 * torch.randn(channels, generator=generator)).requires_grad_()
    bias = (0.1 * torch.randn(channels, generator=generator)).requires_grad_()
    valid = torch.ones(rows, dtype=torch.bool)

    def parameter_grads(fn, x, scale, bias):
        leaves = [scale.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()]
        return torch.autograd.grad(fn(x, leaves[0], leaves[1]), leaves, dy.to(x.dtype))

    ours = parameter_grads(lambda a, s, b: masked_layer_normalization(a, valid, s, b), x, scale,
                           bias)  # fmt: skip
    peer = parameter_grads(lambda a, s, b: F.layer_norm(a, (channels,), s, b), x, scale, bias)
    truth = parameter_grads(lambda a, s, b: F.layer_norm(a, (channels,), s, b), x.double(),
                            scale.double(), bias.double())  # fmt: skip
    for got, torch_got, want in zip(ours, peer, truth, strict=True):
        error = float((got.double() - want).abs().max())
        torch_error = float((torch_got.double() - want).abs().max())
        unit = float(want.abs().max()) * FLOAT32_UNIT  # an ulp of the largest sum
        assert error <= max(2 * torch_error, unit), (error, torch_error, unit)


def offset_rows(kind: str) -> torch.Tensor:
    """Two rows of a tiny spread on a large offset (the mean's rounding error is most of it)."""
    if kind == "float32 -1e-24 with 1e-30 at one channel":
        x = torch.full((2, 33), -1e-24, dtype=torch.float32)
        x[:, 0] += 1e-30
        return x
    if kind == "float32 constant 2e-5":
        return torch.full((2, 4097), 2e-5, dtype=torch.float32)
    if kind == "float64 -1e-144 +- 1e-150":
        generator = torch.Generator().manual_seed(0)
        return -1e-144 + 1e-150 * torch.randn(2, 64, generator=generator, dtype=torch.float64)
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    ["float32 -1e-24 with 1e-30 at one channel", "float32 constant 2e-5",
     "float64 -1e-144 +- 1e-150"],
)  # fmt: skip
def test_tiny_spread_on_a_large_offset_matches_exact_arithmetic(kind):
    """The raw-op kernels skipped the mean's correction when it moved xhat by less than an
    eighth of an ulp of 1 (an absolute test): the float32 row came out 7% off, constant rows
    2.3e-9 instead of 0, and the float64 rows 2e-11 off, as did the float64 reference (no
    correction at all). Against 200-bit arithmetic on the rows' exact values: the op's y and
    dx, and the reference's y."""
    x = offset_rows(kind)
    channels = x.shape[-1]
    generator = torch.Generator().manual_seed(1)
    dy = torch.randn(channels, generator=generator, dtype=torch.float64).tolist()
    ones, zeros = [1.0] * channels, [0.0] * channels
    (want_y, want_dx, _), (y_scale, dx_scale, _) = exact_row(x[0].tolist(), ones, zeros, 1e-5, dy)
    valid = torch.ones(2, dtype=torch.bool)
    scale, bias = torch.ones(channels, dtype=x.dtype), torch.zeros(channels, dtype=x.dtype)
    leaf = x.clone().requires_grad_()
    out = masked_layer_normalization(leaf, valid, scale, bias)
    (dx,) = torch.autograd.grad(out, leaf, torch.tensor([dy, dy], dtype=x.dtype))
    unit = 2.0**-23 if x.dtype == torch.float32 else 2.0**-52
    for got, want, natural in ((out[0], want_y, y_scale), (dx[0], want_dx, dx_scale)):
        error = (got.detach().double() - torch.tensor(want, dtype=torch.float64)).abs().max()
        assert float(error) <= 4 * unit * natural, (kind, float(error), natural)
    reference = reference_masked_layer_norm(x, valid, scale, bias)[0]
    error = (reference - torch.tensor(want_y, dtype=torch.float64)).abs().max()
    assert float(error) <= 4 * 2.0**-52 * max(y_scale, 1e-300), (kind, float(error))
