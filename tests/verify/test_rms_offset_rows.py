"""RMSNorm rows about a common offset (x = -0.6 + 0.0018 N(0, 1)): x / rms(x) is about -1 on
every element, so each row's truth is nearly constant and its factor and shift fit alike. In a
half dtype the output's rounding (bfloat16's spacing near 1 is 0.0078) is larger than the row's
whole spread, and a correct kernel's error is then all rounding, as large as the spread: the
rounding a factor may err by is relative to the spread of the truth over the row, not to its
size. Correct kernels were failed "all 1 valid rows scaled by 0.758 ± 0 and shifted by -0.24"
(bfloat16; float64: "scaled by 1 + 2.1e-14"), found by a hunt for false FAILs."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from maskln_cli import masked_rms_normalization
from maskln_cli.testing import check_kernel


def _finish(y, x, valid):
    return y.to(x.dtype).masked_fill(~valid[..., None], 0)


def rms_in_float32(x, valid, scale, eps, eps_used=None):
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    x0 = x.masked_fill(~valid[..., None], 0).to(compute)
    eps = eps if eps_used is None else eps_used
    return _finish(x0 * torch.rsqrt(x0.square().mean(-1, keepdim=True) + eps) * scale, x, valid)


def rms_torch(x, valid, scale, eps):
    x0 = x.masked_fill(~valid[..., None], 0)
    return _finish(F.rms_norm(x0, x.shape[-1:], scale.to(x.dtype), eps), x, valid)


def maskln_rms(x, valid, scale, eps):
    if x.dtype in (torch.float32, torch.float64):
        scale = scale.to(x.dtype)
    return masked_rms_normalization(x, valid, scale, eps)


CORRECT = {"float32 compute": rms_in_float32, "F.rms_norm": rms_torch, "maskln": maskln_rms}


def offset_rows(dtype, channels, rows, seed, spread=0.003):
    g = torch.Generator().manual_seed(seed)
    x = -0.6 + 0.6 * spread * torch.randn(rows, channels, generator=g, dtype=torch.float64)
    scale = torch.ones(channels, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    grad_out = torch.randn(rows, channels, generator=g, dtype=torch.float64).to(dtype)
    return x.to(dtype), torch.ones(rows, dtype=torch.bool), scale, 1e-5, grad_out


@pytest.mark.parametrize("kernel", list(CORRECT))
@pytest.mark.parametrize(
    ("dtype", "channels", "rows"),
    [
        (torch.bfloat16, 64, 1), (torch.bfloat16, 1025, 4), (torch.bfloat16, 64, 16),
        (torch.float16, 1025, 1), (torch.float16, 64, 16), (torch.float64, 11, 1),
    ],
)  # fmt: skip
@pytest.mark.parametrize("seed", range(3))
def test_correct_rms_kernels_pass_on_offset_rows(kernel, dtype, channels, rows, seed):
    x, valid, scale, eps, grad_out = offset_rows(dtype, channels, rows, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_kernel(CORRECT[kernel], x, valid, scale, None, eps, grad_out, norm="rms")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_wrong_eps_still_fails_on_offset_rows(dtype):
    """eps 0.01 for 1e-5 moves these rows' output by 1.4%: still caught."""
    x, valid, scale, eps, grad_out = offset_rows(dtype, 256, 16, 0)

    def wrong(x, valid, scale, eps):
        return rms_in_float32(x, valid, scale, eps, eps_used=1e-2)

    with warnings.catch_warnings(), pytest.raises(AssertionError, match="FAIL"):
        warnings.simplefilter("ignore")
        check_kernel(wrong, x, valid, scale, None, eps, grad_out, norm="rms")
