"""A kernel's statistics overflow in the range of the dtype it keeps them in: a float64 kernel
squaring a row of 1e200 (F.rms_norm in float64) was told "the row statistics overflow float16
... accumulate the statistics in float32", a dtype it never used; a bfloat16 kernel keeping
float32 statistics on rows of 1e30 likewise (bfloat16 has float32's range). Found by a hunt for
wrong causes. The dtype tried first is the judged one's range; float16 only after it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from maskln_cli.testing import check_kernel


def rms_torch(x, valid, scale, eps):
    x0 = x.masked_fill(~valid[..., None], 0)
    return F.rms_norm(x0, x.shape[-1:], scale.to(x.dtype), eps).masked_fill(~valid[..., None], 0)


def rms_in_float32(x, valid, scale, eps):
    x0 = x.masked_fill(~valid[..., None], 0).float()
    y = x0 * torch.rsqrt(x0.square().mean(-1, keepdim=True) + eps) * scale.float()
    return y.to(x.dtype).masked_fill(~valid[..., None], 0)


def failure(kernel, dtype, big, seed=0, channels=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, channels, generator=g, dtype=torch.float64)
    x[1] *= big
    scale = torch.ones(channels, dtype=dtype if dtype == torch.float64 else torch.float32)
    grad_out = torch.randn(3, channels, generator=g, dtype=torch.float64).to(dtype)
    with warnings.catch_warnings(), pytest.raises(AssertionError) as raised:
        warnings.simplefilter("ignore")
        check_kernel(kernel, x.to(dtype), torch.ones(3, dtype=torch.bool), scale, None, 1e-3,
                     grad_out, norm="rms")  # fmt: skip
    return str(raised.value).splitlines()[0]


@pytest.mark.parametrize(
    ("kernel", "dtype", "big", "range_of"),
    [
        (rms_torch, torch.float64, 1e200, "float64"),
        (rms_in_float32, torch.bfloat16, 1e30, "float32"),
    ],
)
def test_an_overflow_is_named_in_the_range_the_kernel_kept(kernel, dtype, big, range_of):
    said = failure(kernel, dtype, big)
    assert "overflow float16" not in said, said
    assert f"overflow {range_of}" in said, said
