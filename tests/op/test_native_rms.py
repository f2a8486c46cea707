"""The native kernels' RMSNorm (issue 39), called directly: what the native kernels promise for
LayerNorm holds for RMSNorm too, in the kernels the norm is a template parameter of.

The same bits on every instruction set and thread count, from the registered ops and the plain
functions, for any subset of the gradients; half dtypes read exactly and rounded once; the
raw-op kernels to rounding. (Values against float64 are tests/op/test_rms.py's and
tests/op/test_rms_accuracy.py's, on both backends.) Run once, whichever backend (`make test`
leaves it out of its raw-op pass, as test_native_kernel.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from maskln_cli.op import blocked
from maskln_cli.op.backend import active_backend
from maskln_cli.op.norms import RMS
from maskln_cli.op.reference import reference_masked_rms_norm
from tests.op.test_native_kernel import assert_bits_equal, lib  # noqa: F401  (a fixture)
from tests.op.test_rms import make_rms_inputs

EPS = 1e-6
OFFSET = 1.0


def run(lib, x, valid, scale, dy, mask=(True, True), offset=OFFSET):  # noqa: F811
    """(y, rstd), [the requested of dx, dscale] of the native kernels."""
    y, rstd = lib.rms_forward(x, valid, scale, EPS, offset)
    return (y, rstd), lib.rms_backward(dy, x, valid, scale, rstd, EPS, offset, list(mask))


def test_values_statistics_and_gradients(lib):  # noqa: F811
    x, valid, scale = make_rms_inputs((6, 7), 40, torch.float64, poison=True, offset=OFFSET)
    dy = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(1))
    (y, rstd), (dx, dscale) = run(lib, x, valid, scale, dy)
    leaves = [t.clone().requires_grad_() for t in (x, scale)]
    want = reference_masked_rms_norm(leaves[0], valid, leaves[1], EPS, OFFSET)
    want_dx, want_dscale = torch.autograd.grad(want, leaves, dy)
    for got, wanted in ((y, want), (dx, want_dx), (dscale, want_dscale)):
        torch.testing.assert_close(got, wanted.detach(), rtol=1e-12, atol=1e-12)
    clean = torch.where(valid[..., None], x, 0.0)
    want_rstd = torch.where(valid[..., None], clean.square().mean(-1, keepdim=True).add(EPS)
                            .rsqrt(), 0.0)  # fmt: skip
    torch.testing.assert_close(rstd, want_rstd, rtol=1e-14, atol=0)
    y_alone, no_rstd = lib.rms_forward(x, valid, scale, EPS, OFFSET, False)
    assert no_rstd is None and torch.equal(y_alone, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_every_instruction_set_and_thread_count_gives_the_same_bits(lib, dtype):  # noqa: F811
    x, valid, scale = make_rms_inputs((37, 5), 203, torch.float64, seed=2, poison=True)
    x, scale = x.to(dtype), scale.to(torch.float64 if dtype == torch.float64 else torch.float32)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    first, threads = lib.isa(), torch.get_num_threads()
    results, supported = [], []
    try:
        for name in ("base", "avx2", "avx512"):
            try:
                lib.set_isa(name)
            except RuntimeError:  # not on this CPU
                continue
            supported.append(name)
            for count in (1, 2):
                torch.set_num_threads(count)
                (y, rstd), grads = run(lib, x, valid, scale, dy)
                results.append([y, rstd, *grads])
    finally:
        lib.set_isa(first)
        torch.set_num_threads(threads)
    assert "base" in supported
    for result in results[1:]:
        for got, want in zip(result, results[0], strict=True):
            assert_bits_equal(got, want)


def test_registered_ops_plain_functions_and_subsets_of_gradients_agree(lib):  # noqa: F811
    if active_backend().name != "native":
        pytest.skip("the registered ops run the raw-op kernels on this backend")
    x, valid, scale = make_rms_inputs((3, 4), 20, torch.float32, poison=True)
    dy = torch.randn(x.shape)
    (y, rstd), every = run(lib, x, valid, scale, dy)
    op_y, op_rstd = torch.ops.maskln.masked_rms_norm(x, valid, scale, EPS, OFFSET)
    assert_bits_equal(y, op_y)
    assert_bits_equal(rstd, op_rstd)
    for mask in ([True, True], [True, False], [False, True], [False, False]):
        plain = lib.rms_backward(dy, x, valid, scale, rstd, EPS, OFFSET, mask)
        op = torch.ops.maskln.masked_rms_norm_backward(dy, x, valid, scale, rstd, EPS, OFFSET,
                                                       mask)  # fmt: skip
        assert len(plain) == len(op) == sum(mask)
        wanted = [g for g, need in zip(every, mask, strict=True) if need]
        for a, b, want in zip(plain, op, wanted, strict=True):
            assert_bits_equal(a, b)
            assert_bits_equal(a, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_results_are_the_float32_results_rounded_once(lib, dtype):  # noqa: F811
    x, valid, scale = make_rms_inputs((7, 3), 45, torch.float64, seed=8, poison=True)
    x, scale = x.to(dtype), scale.float()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(8)).to(dtype)
    half = run(lib, x, valid, scale, dy)
    wide = run(lib, x.float(), valid, scale, dy.float())
    assert_bits_equal(half[0][0], wide[0][0].to(dtype))
    assert_bits_equal(half[1][0], wide[1][0].to(dtype))
    assert_bits_equal(half[0][1], wide[0][1])
    assert_bits_equal(half[1][1], wide[1][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_raw_op_kernels_agree_to_rounding(lib, dtype):  # noqa: F811
    x, valid, scale = make_rms_inputs((6, 50), 96, dtype, seed=3, poison=True, mean=3.0)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    (y, rstd), (dx, dscale) = run(lib, x, valid, scale, dy)
    y_raw, mean_raw, rstd_raw = blocked.forward(x, valid, scale, None, EPS, True, RMS, OFFSET)
    assert mean_raw is None
    grads = blocked.backward_in_place(dy, x, valid, scale, None, rstd_raw, EPS, True, True, False,
                                      RMS, OFFSET)  # fmt: skip
    assert grads[2] is None
    close = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    for got, raw in ((y, y_raw), (rstd, rstd_raw), (dx, grads[0]), (dscale, grads[1])):
        torch.testing.assert_close(got, raw, **close)


def test_bad_inputs_raise_instead_of_crashing(lib):  # noqa: F811
    x, valid, scale = torch.ones(4, 5), torch.ones(4, dtype=torch.bool), torch.ones(5)
    with pytest.raises(RuntimeError, match="eps"):
        lib.rms_forward(x, valid, scale, math.nan, 0.0)
    with pytest.raises(RuntimeError, match="shape"):
        lib.rms_forward(x, valid, torch.ones(4), EPS, 0.0)
    _, rstd = lib.rms_forward(x, valid, scale, EPS, 0.0)
    with pytest.raises(RuntimeError, match="2 entries"):
        lib.rms_backward(x, x, valid, scale, rstd, EPS, 0.0, [True, True, True])
    with pytest.raises(RuntimeError, match="one value per row"):
        lib.rms_backward(x, x, valid, scale, rstd[:2], EPS, 0.0, [True, True])
    with pytest.raises(ValueError, match="offset must be a finite number, got nan"):
        torch.ops.maskln.masked_rms_norm(x, valid, scale, EPS, math.nan)


def contract_cases():
    """(x, valid, scale, bias, eps, offset) within and outside the contract of either norm (bias
    None: RMSNorm's), every argument of a type the native check takes."""
    x, valid, scale = torch.ones(2, 3, 4), torch.ones(2, 3, dtype=torch.bool), torch.ones(4)
    good = {"x": x, "valid": valid, "scale": scale, "bias": torch.zeros(4), "eps": EPS,
            "offset": 0.0}  # fmt: skip
    double = {"x": x.double(), "scale": scale.double()}
    changes = {
        "good": {},
        "rms": {"bias": None, "offset": 1.0},
        "float64": {**double, "bias": torch.zeros(4).double()},
        "half, float32 scale": {"x": x.half()},
        "bfloat16": {"x": x.bfloat16(), "scale": scale.bfloat16(), "bias": None},
        "x strided": {"x": torch.ones(4, 3, 2).transpose(0, 2)},
        "x integer": {"x": x.long()},
        "x 0-d": {"x": torch.tensor(1.0), "valid": torch.tensor(True)},
        "x sparse": {"x": x.to_sparse()},
        "valid integer": {"valid": valid.long()},
        "valid full shape": {"valid": valid[..., None]},
        "valid wrong axis": {"valid": valid[:, :2]},
        "valid meta": {"valid": valid.to("meta")},
        "scale wrong length": {"scale": scale[:3]},
        "scale wrong rank": {"scale": scale[None]},
        "scale float64": {"scale": scale.double()},
        "scale meta": {"scale": scale.to("meta"), "bias": None},
        "bias wrong length": {"bias": torch.zeros(5)},
        "bias float16": {"bias": torch.zeros(4).half()},
        "eps zero": {"eps": 0.0},
        "eps negative": {"eps": -EPS},
        "eps nan": {"eps": math.nan},
        "eps inf": {"eps": math.inf},
        "eps rounds to 0 in float32": {"eps": 1e-50, "bias": None},
        "eps 1e-50 in float64": {**double, "bias": None, "eps": 1e-50},
        "offset nan": {"bias": None, "offset": math.nan},
        "offset inf": {"bias": None, "offset": -math.inf},
        "offset inf, layer norm (no offset)": {"offset": math.inf},
    }
    return [pytest.param(dict(good, **change), id=name) for name, change in changes.items()]


@pytest.mark.parametrize("arguments", contract_cases())
def test_the_native_contract_check_agrees_with_the_python_checks(lib, arguments):  # noqa: F811
    # The public functions take the native check's yes for the Python checks' (backend.
    # within_contract): it must never say yes where they raise, nor no where they accept.
    from maskln_cli.op.checks import check_inputs, check_rms_inputs

    x, valid, scale, bias, eps, offset = arguments.values()
    try:
        if bias is None:
            check_rms_inputs(x, valid, scale, eps, offset)
        else:
            check_inputs(x, valid, scale, bias, eps)
        accepted = True
    except (TypeError, ValueError):
        accepted = False
    assert lib.within_contract(x, valid, scale, bias, eps, offset) is accepted
