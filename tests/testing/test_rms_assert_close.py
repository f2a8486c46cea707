"""maskln_cli.testing for RMSNorm: ``assert_close`` and ``verify`` take ``norm="rms"`` (and
Gemma's ``offset``), judge as ``maskln verify`` judges an RMSNorm file, and pass maskln's own
op on the strategy's hard draws while failing a wrong kernel, naming no LayerNorm cause."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from maskln_cli import masked_rms_normalization
from maskln_cli.testing import VerifyFailed, assert_close, verify
from maskln_cli.testing.strategies import rms_norm_inputs

RUNS = settings(
    max_examples=30, derandomize=True, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip


def op_and_gradients(x, valid, scale, eps, grad_out, offset=0.0):
    leaves = (x.detach().requires_grad_(), scale.detach().requires_grad_())
    out = masked_rms_normalization(leaves[0], valid, leaves[1], eps, offset=offset)
    grad_x, grad_scale = torch.autograd.grad(out, leaves, grad_out)
    return out.detach(), grad_x, grad_scale


@RUNS
@given(rms_norm_inputs([torch.float32, torch.bfloat16, torch.float16], grad_out=True))
def test_the_op_passes_on_hard_draws(inputs):
    x, valid, scale, eps, grad_out = inputs
    out, grad_x, grad_scale = op_and_gradients(x, valid, scale, eps, grad_out)
    assert_close(
        out, x, valid, scale, None, eps, norm="rms",
        grad_out=grad_out, grad_x=grad_x, grad_scale=grad_scale,
    )  # fmt: skip


def rows(dtype=torch.float32, channels=64):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, channels, generator=generator).to(dtype)
    valid = torch.tensor([True, True, False, True, True, False])
    scale = (1 + 0.3 * torch.randn(channels, generator=generator)).to(dtype)
    grad_out = torch.randn(6, channels, generator=generator).to(dtype)
    return x, valid, scale, grad_out


def test_verify_reports_rms_tensors_and_the_default_eps_is_rmsnorms():
    x, valid, scale, grad_out = rows()
    out, grad_x, grad_scale = op_and_gradients(x, valid, scale, 1e-6, grad_out)
    report = verify(
        out, x, valid, scale, None, norm="rms", grad_out=grad_out, grad_x=grad_x,
        grad_scale=grad_scale,
    )  # fmt: skip
    assert report.passed
    assert [t.name for t in report.tensors] == ["out", "grad_x", "grad_scale"]
    assert report.context["eps"] == 1e-6
    assert report.context["yardstick"] == "torch.nn.functional.rms_norm in float32"


def test_a_wrong_kernel_fails_with_rms_norms_own_cause_named():
    x, valid, scale, _ = rows()
    x = x + 3.0  # rows with a mean: a centered kernel differs
    centered = x - x.mean(-1, keepdim=True)
    wrong = centered * torch.rsqrt(centered.square().mean(-1, keepdim=True) + 1e-6) * scale
    wrong = torch.where(valid[:, None], wrong, 0.0)
    with pytest.raises(VerifyFailed) as failure:
        assert_close(wrong, x, valid, scale, None, 1e-6, norm="rms")
    out = failure.value.report.tensors[0]
    assert not out.passed
    assert [d["mistake"] for d in out.diagnosis] == ["mean_subtracted"]
    assert "the row mean subtracted (LayerNorm where RMSNorm is due)" in str(failure.value)


def test_gemmas_offset_is_judged():
    x, valid, scale, _ = rows()
    out = masked_rms_normalization(x, valid, scale, 1e-6, offset=1.0)
    assert_close(out, x, valid, scale, None, 1e-6, norm="rms", offset=1.0)
    with pytest.raises(VerifyFailed):
        assert_close(out, x, valid, scale, None, 1e-6, norm="rms")


@pytest.mark.parametrize(
    ("arguments", "error", "fragment"),
    [
        ({"bias": "zeros"}, ValueError, "bias"),
        ({"grad_bias": "zeros"}, ValueError, "grad_bias"),
        ({"norm": "batch"}, ValueError, "norm"),
        ({"norm": "layer", "offset": 1.0}, ValueError, "offset"),
        ({"offset": float("nan")}, ValueError, "offset"),
    ],
)
def test_bad_norm_arguments_name_themselves(arguments, error, fragment):
    x, valid, scale, grad_out = rows()
    out = masked_rms_normalization(x, valid, scale, 1e-6)
    given = {"norm": "rms", **arguments}
    bias = torch.zeros(64) if given.pop("bias", None) else None
    if given.pop("grad_bias", None):
        given.update(grad_out=grad_out, grad_bias=torch.zeros(64))
    with pytest.raises(error, match=fragment):
        verify(out, x, valid, scale, bias, 1e-6, **given)
