"""The native CPU kernel (maskln_cli.op.native), called directly, against float64 references
and the raw-op kernels.

Values and gradients are checked against the float64 reference (maskln_cli.op.reference, and
autograd through it), against exact arithmetic on float64 rows of every magnitude, against
F.layer_norm's own float32 error on hard data, and against the raw-op kernels of
maskln_cli.op.blocked. Skipped, with the reason, where the kernel cannot be built (no compiler,
no ninja).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from maskln_cli import masked_layer_normalization
from maskln_cli.op import blocked as core
from maskln_cli.op import native
from maskln_cli.op.backend import active_backend
from maskln_cli.op.reference import reference_masked_layer_norm
from tests.op.test_accuracy import HUGE_ROWS, KINDS, exact_row, float32_error, hard_rows
from tests.op.test_core import (
    TOLERANCE,
    apply_layout,
    make_inputs,
    poison_invalid_rows,
    reference_gradients,
)

EPS = 1e-5
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lib() -> ModuleType:
    reason = native.unavailable_reason()
    if reason is not None:
        pytest.skip(f"native kernel unavailable: {reason}")
    return native.load()


def grads_of(lib, dy, x, valid, scale, mean, rstd, eps=EPS, mask=(True, True, True)):
    computed = iter(lib.backward(dy, x, valid, scale, mean, rstd, eps, list(mask)))
    return [next(computed) if need else None for need in mask]


def native_run(lib, x, valid, scale, bias, dy, eps=EPS):
    """(y, mean, rstd) and (dx, dscale, dbias) of the native kernel."""
    y, mean, rstd = lib.forward(x, valid, scale, bias, eps)
    return (y, mean, rstd), grads_of(lib, dy, x, valid, scale, mean, rstd, eps)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


# --- values and gradients against the float64 reference ----------------------------------------

SHAPES = [(7,), (5, 3), (4, 6, 16), (3, 2, 33), (40, 128), (2, 1000), (3, 5000)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("eps", [1e-5, 0.1])
def test_values_and_gradients_match_the_float64_reference(lib, shape, dtype, eps):
    x, valid, scale, bias = make_inputs(shape[:-1], shape[-1], dtype, seed=len(shape), poison=True)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    (y, mean, rstd), (dx, dscale, dbias) = native_run(lib, x, valid, scale, bias, dy, eps)
    expected = reference_masked_layer_norm(x, valid, scale, bias, eps)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), expected, **TOLERANCE[dtype])
    want = reference_gradients(x, valid, scale, bias, eps, dy)
    tolerance = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else TOLERANCE[dtype]
    for got, wanted in zip((dx, dscale, dbias), want, strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), wanted, **tolerance)
    assert mean.shape == rstd.shape == (*x.shape[:-1], 1)
    assert mean.dtype == rstd.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_and_gradients_match_the_raw_op_path(lib, dtype):
    """The raw-op kernels' forward and backward_in_place: the same op, to rounding."""
    x, valid, scale, bias = make_inputs((6, 50), 96, dtype, seed=3, poison=True, offset=3.0)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    (y, mean, rstd), grads = native_run(lib, x, valid, scale, bias, dy)
    y_core, mean_core, rstd_core = core.forward(x, valid, scale, bias, EPS)
    grads_core = core.backward_in_place(dy, x, valid, scale, mean_core, rstd_core, EPS)
    close = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(y, y_core, **close)
    torch.testing.assert_close(mean, mean_core, **close)
    torch.testing.assert_close(rstd, rstd_core, **close)
    for got, theirs in zip(grads, grads_core, strict=True):  # sums of 300 rows: looser
        torch.testing.assert_close(got, theirs, **TOLERANCE[dtype])


def test_a_wrong_kernel_would_fail(lib):
    """The reference comparison can fail: an unbiased variance is caught at this tolerance."""
    x, valid, scale, bias = make_inputs((30,), 8, torch.float32)
    y = lib.forward(x, valid, scale, bias, EPS)[0]
    rows = x.double()
    wrong = (rows - rows.mean(-1, keepdim=True)) / (rows.var(-1, keepdim=True) + EPS).sqrt()
    wrong = torch.where(valid[..., None], wrong * scale.double() + bias.double(), 0.0)
    expected = reference_masked_layer_norm(x, valid, scale, bias, EPS)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(wrong, expected, **TOLERANCE[torch.float32])
    torch.testing.assert_close(y.double(), expected, **TOLERANCE[torch.float32])


# --- hard data: float32 errors against F.layer_norm's own ----------------------------------------


def float32_errors(lib, x64: torch.Tensor, dy: torch.Tensor | None = None):
    """(native, F.layer_norm) float32 errors of y (and of dx with dy), in ulps of each element
    floored at its row's RMS, against float64 (as tests/test_accuracy.py measures them)."""
    channels = x64.shape[-1]
    x = x64.float()
    valid = torch.ones(x.shape[:-1], dtype=torch.bool)
    ones, zeros = torch.ones(channels), torch.zeros(channels)
    y, mean, rstd = lib.forward(x, valid, ones, zeros, EPS)
    truth = F.layer_norm(x.double(), (channels,), eps=EPS)
    peer = F.layer_norm(x, (channels,), eps=EPS)
    errors = [(float32_error(y, truth), float32_error(peer, truth))]
    if dy is not None:
        (dx,) = grads_of(lib, dy, x, valid, ones, mean, rstd, mask=(True, False, False))[:1]
        leaves = [x.clone().requires_grad_(), x.double().requires_grad_()]
        peer_dx = torch.autograd.grad(F.layer_norm(leaves[0], (channels,), eps=EPS), leaves[0], dy)
        true_dx = torch.autograd.grad(
            F.layer_norm(leaves[1], (channels,), eps=EPS), leaves[1], dy.double()
        )
        errors.append((float32_error(dx, true_dx[0]), float32_error(peer_dx[0], true_dx[0])))
    return errors


@pytest.mark.parametrize("channels", [128, 4096, 65536, 262144])
@pytest.mark.parametrize("kind", KINDS)
def test_float32_hard_rows_within_twice_torch_and_a_few_ulps(lib, kind, channels):
    """Long rows, heavy tails (lognormal, cauchy), sparse spikes, an outlier channel of 3000,
    an offset of 1e4: at most twice F.layer_norm's error (or one ulp), and under 2 ulps."""
    rows = max(2, min(64, 2**20 // channels))
    dy = torch.randn(rows, channels, generator=torch.Generator().manual_seed(5))
    (ours, peer), (ours_dx, peer_dx) = float32_errors(
        lib, hard_rows(kind, rows, channels, seed=channels), dy
    )
    assert ours <= max(2 * peer, 1.0), (ours, peer)
    assert ours < 2.0, ours
    assert ours_dx <= max(2 * peer_dx, 1.0), (ours_dx, peer_dx)
    if kind == "offset":  # the corrected two-pass against torch's plain one
        assert ours * 100 < peer


def test_float32_rows_of_4_million_channels(lib):
    x64 = hard_rows("lognormal", 2, 2**22, seed=3)
    dy = torch.randn(x64.shape, generator=torch.Generator().manual_seed(4))
    (ours, peer), (ours_dx, peer_dx) = float32_errors(lib, x64, dy)
    assert ours <= max(2 * peer, 1.0) and ours < 2.0, (ours, peer)
    assert ours_dx <= max(2 * peer_dx, 1.0), (ours_dx, peer_dx)


@pytest.mark.parametrize("row", HUGE_ROWS.values(), ids=HUGE_ROWS.keys())
def test_float64_rows_of_any_magnitude_match_exact_arithmetic(lib, row):
    """1e155 to 1.7e308 (squares overflow; the power-of-two rescue), 1e-300, subnormals."""
    channels = len(row)
    generator = torch.Generator().manual_seed(channels)
    scale = (1 + torch.rand(channels, generator=generator, dtype=torch.float64)).tolist()
    bias = torch.randn(channels, generator=generator, dtype=torch.float64).tolist()
    dy = torch.randn(channels, generator=generator, dtype=torch.float64).tolist()
    (want_y, want_dx, want_dscale), scales = exact_row(row, scale, bias, EPS, dy)
    x = torch.tensor([row, row], dtype=torch.float64)  # row 1 an invalid copy
    valid = torch.tensor([True, False])
    scale_t, bias_t = (torch.tensor(v, dtype=torch.float64) for v in (scale, bias))
    dy_t = torch.tensor([dy, dy], dtype=torch.float64)
    (y, _, _), (dx, dscale, _) = native_run(lib, x, valid, scale_t, bias_t, dy_t)

    def close(got: torch.Tensor, want: list[float], natural_scale: float) -> bool:
        allowed = max(8 * 2.0**-52 * natural_scale, torch.finfo(torch.float64).tiny)
        return bool(((got - torch.tensor(want, dtype=torch.float64)).abs() <= allowed).all())

    assert close(y[0], want_y, scales[0]), (y[0].tolist(), want_y)
    assert close(dx[0], want_dx, scales[1]), (dx[0].tolist(), want_dx)
    assert close(dscale, want_dscale, scales[2]), (dscale.tolist(), want_dscale)
    assert not bits(y[1]).any() and not bits(dx[1]).any()


@pytest.mark.parametrize(
    "row",
    [
        [1e20, 2e20, -3e20, 0.0],  # |xc|^2 overflows float32
        [3e38, 3e38, 3e38, 3e38],  # the sum overflows float32
        [3e38, -3e38, 3e38, 0.0],  # rstd subnormal in float32: the backward's rescue
        [1e-30, -3e-30, 2e-30, 0.0],
        [1e-40, -3e-40, 2e-40, 0.0],  # subnormal
    ],
)
def test_float32_rows_of_extreme_magnitude_match_the_reference(lib, row):
    x = torch.tensor([row, [1.0, 2.0, 3.0, 5.0], [7.0, 7.0, 1e30, math.nan]])
    valid = torch.tensor([True, True, False])
    scale, bias = torch.tensor([1.0, -2.0, 0.5, 1.5]), torch.tensor([0.25, 0.0, -1.0, 0.5])
    dy = torch.tensor([[1.0, -1.0, 0.5, 2.0]]).expand(3, 4)
    (y, _, _), grads = native_run(lib, x, valid, scale, bias, dy)
    torch.testing.assert_close(y.double(), reference_masked_layer_norm(x, valid, scale, bias))
    for got, want in zip(grads, reference_gradients(x, valid, scale, bias, EPS, dy), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("exponent", [0, 100, 510, 1000])
def test_float64_results_do_not_depend_on_a_power_of_two_scale_of_x(lib, exponent):
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    valid = torch.ones(16, dtype=torch.bool)
    scale, bias = torch.ones(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
    base = lib.forward(x, valid, scale, bias, 1e-300)[0]
    scaled_x = torch.ldexp(x, torch.tensor(float(exponent), dtype=torch.float64))
    scaled = lib.forward(scaled_x, valid, scale, bias, 1e-300)[0]
    torch.testing.assert_close(scaled, base, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_constant_rows_give_bias_with_rstd_of_eps(lib, dtype):
    x = torch.full((3, 10), 7.25, dtype=dtype)
    valid = torch.ones(3, dtype=torch.bool)
    scale, bias = torch.randn(10, dtype=dtype), torch.randn(10, dtype=dtype)
    y, mean, rstd = lib.forward(x, valid, scale, bias, EPS)
    assert torch.equal(y, bias.expand(3, 10))
    assert torch.equal(mean, torch.full((3, 1), 7.25, dtype=dtype))
    torch.testing.assert_close(rstd, torch.full((3, 1), 1 / math.sqrt(EPS), dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nan_or_inf_in_a_valid_row_gives_nan_there_only(lib, dtype):
    x, valid, scale, bias = make_inputs((6, 5), 8, dtype, poison=True, valid_fraction=0.7)
    rows = valid.nonzero()[:3]
    for (i, j), value in zip(rows.tolist(), (math.nan, math.inf, -math.inf), strict=True):
        x[i, j, 2] = value
    y = lib.forward(x, valid, scale, bias, EPS)[0]
    expected = reference_masked_layer_norm(x, valid, scale, bias)
    torch.testing.assert_close(y.double(), expected, equal_nan=True, **TOLERANCE[dtype])
    for i, j in rows.tolist():
        assert y[i, j].isnan().all()


# --- invalid rows --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_padding_never_reaches_outputs_statistics_or_gradients(lib, dtype):
    """NaN, inf and 1e30 in the invalid rows of x and dy change no bit of anything."""
    x, valid, scale, bias = make_inputs((9, 7), 40, torch.float64, seed=4, valid_fraction=0.6)
    x, scale, bias = x.to(dtype), scale.to(dtype), bias.to(dtype)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    clean = native_run(lib, x, valid, scale, bias, dy)
    dirty = native_run(
        lib, poison_invalid_rows(x, valid), valid, scale, bias, poison_invalid_rows(dy, valid)
    )
    for got, want in zip([*dirty[0], *dirty[1]], [*clean[0], *clean[1]], strict=True):
        assert got.isfinite().all()
        assert_bits_equal(got, want)
    (y, mean, rstd), (dx, _, _) = dirty
    for tensor in (y, dx, mean, rstd):
        invalid = tensor[~valid]
        assert not bits(invalid).any()  # +0.0: all bits zero, never -0.0


def test_invalid_rows_are_positive_zero_with_negative_or_infinite_parameters(lib):
    x, valid, scale, bias = make_inputs((5, 4), 6, torch.float32, poison=True, valid_fraction=0.5)
    scale, bias = -scale.abs(), -bias.abs()
    scale[1], bias[2] = math.inf, math.nan
    dy = torch.full(x.shape, -1.0)
    (y, _, _), (dx, _, _) = native_run(lib, x, valid, scale, bias, dy)
    assert not bits(y[~valid]).any() and not bits(dx[~valid]).any()


def test_all_rows_invalid(lib):
    x, valid, scale, bias = make_inputs((4,), 5, torch.float32, valid_fraction=0.0, poison=True)
    dy = poison_invalid_rows(torch.ones_like(x), valid)
    (y, mean, rstd), grads = native_run(lib, x, valid, scale, bias, dy)
    for tensor in (y, mean, rstd, *grads):
        assert not bits(tensor).any()


# --- shapes and layouts --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_channel(lib, dtype):
    x, valid, scale, bias = make_inputs((6,), 1, dtype, poison=True)
    dy = torch.randn(x.shape, dtype=dtype)
    (y, _, _), (dx, dscale, dbias) = native_run(lib, x, valid, scale, bias, dy)
    assert torch.equal(y, torch.where(valid[:, None], bias, 0.0))  # xhat = 0
    assert torch.equal(dx, torch.zeros_like(dx))  # and exactly: wdy - c2 = 0
    assert torch.equal(dscale, torch.zeros_like(dscale))
    torch.testing.assert_close(dbias, dy[valid].sum(0))


def test_zero_channels(lib):
    x, valid = torch.empty(3, 0), torch.tensor([True, False, True])
    y, mean, rstd = lib.forward(x, valid, torch.empty(0), torch.empty(0), EPS)
    assert y.shape == (3, 0) and mean.shape == rstd.shape == (3, 1)
    assert not mean.any() and not rstd.any()  # as maskln_cli.op.blocked.forward
    dx, dscale, dbias = lib.backward(x, x, valid, torch.empty(0), mean, rstd, EPS, [True] * 3)
    assert dx.shape == (3, 0) and dscale.shape == dbias.shape == (0,)


@pytest.mark.parametrize("leading", [(0,), (0, 3), (2, 0)])
def test_empty_inputs(lib, leading):
    x = torch.empty(*leading, 4)
    valid = torch.empty(leading, dtype=torch.bool)
    scale, bias = torch.ones(4), torch.zeros(4)
    y, mean, rstd = lib.forward(x, valid, scale, bias, EPS)
    assert y.shape == x.shape and mean.shape == (*leading, 1)
    dx, dscale, dbias = lib.backward(x, x, valid, scale, mean, rstd, EPS, [True] * 3)
    assert dx.shape == x.shape
    assert torch.equal(dscale, torch.zeros(4)) and torch.equal(dbias, torch.zeros(4))


@pytest.mark.parametrize("is_valid", [True, False])
def test_one_row_with_zero_dim_valid(lib, is_valid):
    x = torch.tensor([1.0, 3.0, -2.0, 7.0])
    scale, bias = torch.tensor([2.0, -1.0, 1.0, 0.5]), torch.tensor([0.5, 1.0, 0.0, -1.0])
    valid = torch.tensor(is_valid)
    dy = torch.tensor([1.0, 0.0, -2.0, 3.0])
    (y, mean, rstd), grads = native_run(lib, x, valid, scale, bias, dy)
    assert y.shape == (4,) and mean.shape == rstd.shape == (1,)
    torch.testing.assert_close(y.double(), reference_masked_layer_norm(x, valid, scale, bias))
    for got, want in zip(grads, reference_gradients(x, valid, scale, bias, EPS, dy), strict=True):
        torch.testing.assert_close(got.double(), want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize(
    "layout", ["permuted", "stepped", "expanded", "channels_strided", "transposed"]
)
def test_any_layout_gives_the_contiguous_bits_in_empty_like_strides(lib, layout):
    x, valid, scale, bias = make_inputs((4, 6), 10, torch.float32, poison=True)
    dy = torch.randn(x.shape)
    if layout == "expanded":
        x, valid, dy = x[:1].expand(x.shape), valid[:1].expand(valid.shape), dy[:1].expand(x.shape)
        strided = x
    elif layout == "transposed":
        strided = x.transpose(0, 1).contiguous().transpose(0, 1)
    else:
        strided = apply_layout(x, layout)
    assert not strided.is_contiguous()
    contiguous = native_run(lib, x.contiguous(), valid, scale, bias, dy.contiguous())
    got = native_run(lib, strided, valid, scale, bias, apply_layout(dy, "stepped"))
    y, dx = got[0][0], got[1][0]
    assert y.stride() == torch.empty_like(strided).stride()
    assert dx.stride() == torch.empty_like(strided).stride()
    for a, b in zip([*got[0], *got[1]], [*contiguous[0], *contiguous[1]], strict=True):
        assert torch.equal(a.contiguous(), b)


def test_non_contiguous_parameters_and_valid(lib):
    x, valid, scale, bias = make_inputs((6,), 12, torch.float64, poison=True)
    stepped = [apply_layout(t, "stepped") for t in (scale, bias)]
    valid_stepped = apply_layout(valid[:, None], "stepped")[:, 0]
    assert not valid_stepped.is_contiguous()
    dy = torch.randn(x.shape, dtype=torch.float64)
    want = native_run(lib, x, valid, scale, bias, dy)
    got = native_run(lib, x, valid_stepped, *stepped, dy)
    for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]], strict=True):
        assert torch.equal(a, b)


# --- determinism and instruction sets ------------------------------------------------------------


def test_the_kernels_run_on_torchs_threads(lib):
    """at::parallel_for is a header template: built without OpenMP, it runs every call on one
    thread (it did until the build passed -fopenmp), and the next test compared nothing."""
    assert lib.intra_op_parallel()


@pytest.mark.parametrize("shape", [(4096, 16), (2000, 300), (64, 4097), (32, 65536)], ids=str)
def test_bits_do_not_depend_on_the_thread_count(lib, shape):
    """dscale and dbias are sums over fixed row blocks, added in order: the same bits on one
    thread and on two (and y, dx, which are per row, too)."""
    x, valid, scale, bias = make_inputs(shape[:-1], shape[-1], torch.float32, seed=9)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            (y, mean, rstd), grads = native_run(lib, x, valid, scale, bias, dy)
            results.append([y, mean, rstd, *grads])
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results, strict=True):
        assert_bits_equal(one, two)


def test_every_instruction_set_gives_the_same_bits(lib):
    """-ffp-contract=off and a fixed order of additions: AVX-512, AVX2 and the baseline agree."""
    x, valid, scale, bias = make_inputs((37, 5), 203, torch.float32, seed=2, poison=True)
    dy = torch.randn(x.shape)
    supported = []
    first = lib.isa()
    try:
        for name in ("base", "avx2", "avx512"):
            try:
                lib.set_isa(name)
            except RuntimeError:  # not on this CPU
                continue
            supported.append(name)
            (y, mean, rstd), grads = native_run(lib, x, valid, scale, bias, dy)
            if len(supported) == 1:
                reference = [y, mean, rstd, *grads]
            for got, want in zip([y, mean, rstd, *grads], reference, strict=True):
                assert_bits_equal(got, want)
    finally:
        lib.set_isa(first)
    assert "base" in supported


# --- half dtypes ---------------------------------------------------------------------------------


def half_ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each value (float64), its smallest normal spacing below."""
    info = torch.finfo(dtype)
    magnitude = values.double().abs().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(magnitude))) * info.eps


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("parameters", ["float32", "half"])
def test_half_dtypes_match_the_float32_path_within_half_rounding(lib, dtype, parameters):
    x, valid, scale, bias = make_inputs((12, 5), 72, torch.float64, seed=6, poison=True)
    x = x.to(dtype)
    param_dtype = torch.float32 if parameters == "float32" else dtype
    scale, bias = scale.to(param_dtype), bias.to(param_dtype)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).to(dtype)
    (y, mean, rstd), (dx, dscale, dbias) = native_run(lib, x, valid, scale, bias, dy)
    assert y.dtype == dx.dtype == dtype
    assert mean.dtype == rstd.dtype == torch.float32
    assert dscale.dtype == dbias.dtype == param_dtype
    # Today's path: x cast to float32, computed there, the result cast back.
    leaves = [t.clone().requires_grad_() for t in (x, scale, bias)]
    theirs = masked_layer_normalization(leaves[0], valid, leaves[1], leaves[2])
    their_grads = torch.autograd.grad(theirs, leaves, dy)
    assert (y.double() - theirs.double()).abs().le(half_ulp(theirs, dtype)).all()
    assert (dx.double() - their_grads[0].double()).abs().le(half_ulp(their_grads[0], dtype)).all()
    for ours, their in zip((dscale, dbias), their_grads[1:], strict=True):
        torch.testing.assert_close(ours, their, **TOLERANCE[param_dtype])
    torch.testing.assert_close(
        y.double(), reference_masked_layer_norm(x, valid, scale, bias), **TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_results_are_the_float32_results_rounded_once(lib, dtype):
    """Halves are read exactly and computed as float32 x is: the outputs are the float32
    kernel's, rounded to the half dtype (vector and scalar tails, 8 + 5 channels and more)."""
    x, valid, scale, bias = make_inputs((7, 3), 45, torch.float64, seed=8, poison=True)
    x = x.to(dtype)
    scale, bias = scale.float(), bias.float()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(8)).to(dtype)
    half = native_run(lib, x, valid, scale, bias, dy)
    wide = native_run(lib, x.float(), valid, scale, bias, dy.float())
    assert_bits_equal(half[0][0], wide[0][0].to(dtype))
    assert_bits_equal(half[1][0], wide[1][0].to(dtype))
    for got, want in zip([*half[0][1:], *half[1][1:]], [*wide[0][1:], *wide[1][1:]], strict=True):
        assert_bits_equal(got, want)


# --- the entry points ----------------------------------------------------------------------------


def test_the_registered_ops_and_plain_functions_agree(lib):
    """The library's CPU kernels of maskln's ops (what compiled and exported graphs call) and
    its pybind functions (the eager path) give the same bits."""
    if active_backend().name != "native":
        pytest.skip("the registered ops run the raw-op kernels on this backend")
    x, valid, scale, bias = make_inputs((3, 4), 20, torch.float64, poison=True)
    dy = torch.randn(x.shape, dtype=torch.float64)
    y, mean, rstd = lib.forward(x, valid, scale, bias, EPS)
    op_y, op_mean, op_rstd = torch.ops.maskln.masked_layer_norm(x, valid, scale, bias, EPS)
    for a, b in ((y, op_y), (mean, op_mean), (rstd, op_rstd)):
        assert torch.equal(a, b)
    for mask in ([True, True, True], [True, False, False], [False, True, False], [False] * 3):
        plain = lib.backward(dy, x, valid, scale, mean, rstd, EPS, mask)
        op = torch.ops.maskln.masked_layer_norm_backward(dy, x, valid, scale, mean, rstd, EPS, mask)
        assert len(plain) == len(op) == sum(mask)
        for a, b in zip(plain, op, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, True),
                                  (False, False, True), (False, True, False)])  # fmt: skip
def test_any_subset_of_gradients_has_the_bits_of_all_three(lib, mask):
    x, valid, scale, bias = make_inputs((10,), 30, torch.float32, poison=True)
    dy = torch.randn(x.shape)
    _, mean, rstd = lib.forward(x, valid, scale, bias, EPS)
    every = grads_of(lib, dy, x, valid, scale, mean, rstd)
    some = grads_of(lib, dy, x, valid, scale, mean, rstd, mask=mask)
    for need, got, want in zip(mask, some, every, strict=True):
        assert (got is not None) == need
        if need:
            assert_bits_equal(got, want)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"valid": torch.ones(3, dtype=torch.bool)}, "leading shape"),
        ({"valid": torch.ones(4)}, "bool"),
        ({"scale": torch.ones(4)}, "shape"),
        ({"bias": torch.ones(5, dtype=torch.int32)}, "dtype"),
        ({"x": torch.ones(4, 5, dtype=torch.int32)}, "float32"),
        ({"eps": 0.0}, "eps"),
        ({"eps": math.nan}, "eps"),
    ],
)
def test_bad_inputs_raise_instead_of_crashing(lib, change, message):
    args = {"x": torch.ones(4, 5), "valid": torch.ones(4, dtype=torch.bool),
            "scale": torch.ones(5), "bias": torch.ones(5), "eps": EPS}  # fmt: skip
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        lib.forward(args["x"], args["valid"], args["scale"], args["bias"], args["eps"])


def test_backward_refuses_statistics_of_another_shape(lib):
    x, valid = torch.ones(4, 5), torch.ones(4, dtype=torch.bool)
    ones, every = torch.ones(5), [True] * 3
    with pytest.raises(RuntimeError, match="one value per row"):
        lib.backward(x, x, valid, ones, torch.ones(3, 1), torch.ones(3, 1), EPS, every)
    with pytest.raises(RuntimeError, match="dy"):
        lib.backward(x[:2], x, valid, ones, torch.ones(4, 1), torch.ones(4, 1), EPS, every)


# --- the loader ----------------------------------------------------------------------------------


def test_cache_folder_is_keyed_by_torch_python_and_source_hash(lib):
    path = native.library_path()
    assert path.exists()
    key = path.parent.name
    assert torch.__version__ in key and sys.implementation.cache_tag in key
    assert native.source_hash() in key and native.source_hash() in path.name


def test_no_compiler_is_a_clear_reason_not_a_crash(monkeypatch, tmp_path):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(native.NativeUnavailable, match="no C\\+\\+ compiler"):
        native._load_or_build()


@pytest.mark.slow  # real processes, tens of seconds: make test-slow
def test_module_entry_point_builds_or_finds_the_library(lib):
    done = subprocess.run(
        [sys.executable, "-m", "maskln_cli.op.native"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert str(native.library_path()) in done.stdout


@pytest.mark.slow  # real processes, tens of seconds: make test-slow
def test_processes_starting_together_build_once(lib, tmp_path):
    """Four processes load from an empty cache at once: one builds (here a stand-in compile
    that copies the library after a pause), the others wait for its lock, saying for whom,
    and load its result."""
    script = textwrap.dedent(
        f"""
        import os, shutil, sys, time
        from pathlib import Path
        from maskln_cli.op import native
        def compile(scratch, name):
            with open({str(tmp_path / "builds")!r}, "a") as log:
                log.write(f"{{os.getpid()}}\\n")
            time.sleep(2.0)
            built = Path(scratch) / (name + native.LIBRARY_SUFFIX)
            shutil.copy({str(native.library_path())!r}, built)
            return built
        native._compile = compile
        module = native.load()
        print(module.isa())
        """
    )
    env = dict(os.environ, **{native.CACHE_ENV: str(tmp_path / "cache")})
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env=env,
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(4)
    ]
    outputs = [process.communicate(timeout=120) for process in processes]
    for process, (out, err) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, err
        assert out.strip() == lib.isa()
    builders = (tmp_path / "builds").read_text().split()
    assert len(builders) == 1
    for _, err in outputs:  # a waiter names the builder
        assert "another process" not in err
        for line in err.splitlines():
            if "waiting for" in line:
                assert f"waiting for process {builders[0]} " in line, err


def test_kernels_registered_on_maskln_custom_ops_follow_the_backend(lib):
    """On the native backend the kernels are the CPU implementation of maskln's own ops (and
    their autograd calls them); back on the raw one, the ops run the raw-op kernels again. In a
    subprocess: the registration is process-wide."""
    script = textwrap.dedent(
        """
        import torch
        from maskln_cli.op import backend, blocked, native
        from tests.op.test_core import make_inputs
        lib = native.load()
        x, valid, scale, bias = make_inputs((6, 5), 33, torch.float32, poison=True)
        dy = torch.randn(x.shape)
        native_y, mean, rstd = lib.forward(x, valid, scale, bias, 1e-5)
        native_grads = lib.backward(dy, x, valid, scale, mean, rstd, 1e-5, [True] * 3)
        raw_y = blocked.forward(x, valid, scale, bias, 1e-5)[0]
        assert not torch.equal(raw_y, native_y)  # so the checks below tell the two apart
        op = torch.ops.maskln.masked_layer_norm
        backward_op = torch.ops.maskln.masked_layer_norm_backward
        assert torch.equal(op(x, valid, scale, bias, 1e-5)[0], raw_y)  # MASKLN_BACKEND=raw
        backend.set_backend("native")
        backend.forward(x, valid, scale, bias, 1e-5)  # the first call loads and registers
        y, mean_op, rstd_op = op(x, valid, scale, bias, 1e-5)
        assert torch.equal(y, native_y) and torch.equal(rstd_op, rstd)
        grads = backward_op(dy, x, valid, scale, mean, rstd, 1e-5, [True] * 3)
        assert all(torch.equal(a, b) for a, b in zip(grads, native_grads))
        leaves = [t.clone().requires_grad_() for t in (x, scale, bias)]
        out = op(leaves[0], valid, leaves[1], leaves[2], 1e-5)[0]
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out, leaves, dy),
                                                     native_grads))
        backend.set_backend("raw")
        assert torch.equal(op(x, valid, scale, bias, 1e-5)[0], raw_y)
        print("ok")
        """
    )
    env = dict(os.environ, MASKLN_BACKEND="raw")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300,
        env=env,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_load_without_building_says_it_is_not_built(monkeypatch, tmp_path):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_failure", None)
    with pytest.raises(native.NativeUnavailable, match="not built yet"):
        native.load(build=False)
    assert not native.available(build=False)
    assert native._failure is None  # a later load may still build
