"""``check_kernel(..., norm="rms")`` (issue 39): an RMSNorm kernel, called as
``kernel(x, valid, scale, eps)`` (``offset=`` too when the gain has one) on copies of its
inputs, judged by RMSNorm's budget against the inputs as given; a wrong one fails with its
cause, one that changes an input fails naming it."""

from __future__ import annotations

import pytest
import torch

from maskln_cli import masked_rms_normalization
from maskln_cli.testing import InputModified, VerifyFailed, check_kernel


def inputs(dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(4, 6, 64, generator=generator, dtype=torch.float64)).to(dtype)
    valid = torch.rand(4, 6, generator=generator) < 0.7
    x[~valid] = float("nan")
    scale = (0.3 * torch.randn(64, generator=generator, dtype=torch.float64)).to(dtype)
    grad_out = torch.randn(x.shape, generator=generator, dtype=torch.float64).to(dtype)
    return x, valid, scale, grad_out


def plain_rms(x, valid, scale, eps, offset=0.0):
    """RMSNorm in plain float64 ops, cast back (an independent reference kernel)."""
    rows = torch.where(valid[..., None], x.double(), 0.0)
    out = rows * torch.rsqrt(rows.square().mean(-1, keepdim=True) + eps) * (offset + scale.double())
    return torch.where(valid[..., None], out, 0.0).to(x.dtype)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_correct_rms_kernel_passes_with_its_gradients(dtype, offset):
    x, valid, scale, grad_out = inputs(dtype)
    if not offset:
        scale = (scale.double() + 1).to(dtype)
    calls = []

    def kernel(*args, **kwargs):
        calls.append((len(args), sorted(kwargs)))
        return masked_rms_normalization(*args, **kwargs)

    check_kernel(kernel, x, valid, scale, None, 1e-6, grad_out, norm="rms", offset=offset)
    check_kernel(plain_rms, x, valid, scale, None, 1e-6, norm="rms", offset=offset)
    assert calls == [(4, ["offset"] if offset else [])]  # (x, valid, scale, eps), no bias


def test_a_wrong_rms_kernel_fails_with_its_cause():
    x, valid, scale, grad_out = inputs()
    scale = scale + 1

    def centered(x, valid, scale, eps):  # LayerNorm where RMSNorm is due
        rows = torch.where(valid[..., None], x, 0.0)
        rows = rows - rows.mean(-1, keepdim=True)
        return masked_rms_normalization(rows, valid, scale, eps)

    with pytest.raises(VerifyFailed) as failure:
        check_kernel(centered, x, valid, scale, None, 1e-6, grad_out, norm="rms")
    report = failure.value.report
    assert [t.name for t in report.tensors] == ["out", "grad_x", "grad_scale"]
    assert [d["mistake"] for d in report.tensors[0].diagnosis] == ["mean_subtracted"]
    # a kernel off by 1e-3 fails too, unnamed (no mistake of the catalogue)
    with pytest.raises(VerifyFailed):
        check_kernel(lambda *a: plain_rms(*a) * (1 + 1e-3), x, valid, scale, None, 1e-6,
                     norm="rms")  # fmt: skip


def test_an_rms_kernel_that_changes_an_input_fails_naming_it():
    x, valid, scale, _ = inputs()

    def sanitizing(x, valid, scale, eps):  # right, but it zeroes x's padding in place
        x[~valid] = 0
        return masked_rms_normalization(x, valid, scale, eps)

    with pytest.raises(InputModified) as failure:
        check_kernel(sanitizing, x, valid, scale + 1, None, 1e-6, norm="rms")
    assert list(failure.value.modified) == ["x"]
    assert failure.value.report.passed  # its out is right, against the inputs as given
    assert bool(x[~valid].isnan().all())  # the caller's x untouched


def test_bias_and_offset_are_refused_where_the_norm_has_none():
    x, valid, scale, _ = inputs()
    with pytest.raises(ValueError, match="bias must be None for norm='rms'"):
        check_kernel(masked_rms_normalization, x, valid, scale, torch.zeros(64), norm="rms")
    with pytest.raises(ValueError, match="offset"):
        check_kernel(lambda *a: a[0], x, valid, scale, None, offset=1.0)
