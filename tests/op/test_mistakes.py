"""The known-mistake catalogue: each mistake's output is recognized as that mistake, and as no
other; correct results (in float32 too, torch's own included) match none."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from maskln_cli.op.mistakes import (
    MISTAKES,
    correct,
    diagnose_gradient,
    diagnose_nan_gradient,
    diagnose_output,
    overflow_match,
    relative_distance,
)


def padded_batch(dtype=torch.float32, seed=0, spread=2.0):
    generator = torch.Generator().manual_seed(seed)
    x = (1 + spread * torch.randn(8, 16, 32, generator=generator, dtype=torch.float64)).to(dtype)
    valid = torch.rand(8, 16, generator=generator) < 0.7
    x[~valid] = math.nan
    scale = (1 + 0.3 * torch.randn(32, generator=generator, dtype=torch.float64)).to(dtype)
    bias = torch.randn(32, generator=generator, dtype=torch.float64).to(dtype)
    return x, valid, scale, bias


@pytest.mark.parametrize("name", list(MISTAKES))
@pytest.mark.parametrize("eps", [1e-5, 3.0])
def test_each_mistake_is_recognized_as_itself_only(name, eps):
    x, valid, scale, bias = padded_batch(spread=0.5)
    wrong = MISTAKES[name].formula(x.double(), valid, scale.double(), bias.double(), eps)
    found = diagnose_output(wrong.float(), x, valid, scale, bias, eps)
    assert [d.mistake for d in found] == [name]
    assert found[0].description and found[0].fix


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_correct_results_match_no_mistake(dtype):
    x, valid, scale, bias = padded_batch(dtype)
    out = correct(x.double(), valid, scale.double(), bias.double(), 1e-5).to(dtype)
    assert diagnose_output(out, x, valid, scale, bias, 1e-5) == []
    clean = torch.where(valid[..., None], x, 0.0)
    torch_out = F.layer_norm(clean, (32,), scale, bias, 1e-5).masked_fill(~valid[..., None], 0)
    assert diagnose_output(torch_out, x, valid, scale, bias, 1e-5) == []


def offset_rows(offset=1e3):
    generator = torch.Generator().manual_seed(1)
    x = (offset + 0.1 * torch.randn(64, 128, generator=generator, dtype=torch.float64)).float()
    return x, torch.ones(64, dtype=torch.bool), torch.ones(128), torch.zeros(128)


def test_one_pass_variance_is_recognized_by_its_error_on_offset_rows():
    x, valid, scale, bias = offset_rows()
    mean = x.mean(-1, keepdim=True)
    var = (x * x).mean(-1, keepdim=True) - mean * mean
    one_pass = (x - mean) / torch.sqrt(var.clamp_min(0) + 1e-5)
    assert [d.mistake for d in diagnose_output(one_pass, x, valid, scale, bias, 1e-5)] == [
        "one_pass_variance"
    ]
    # A correct float32 two-pass kernel (torch's) on the same rows is not one.
    assert diagnose_output(F.layer_norm(x, (128,)), x, valid, scale, bias, 1e-5) == []


def test_an_unknown_mistake_matches_nothing():
    x, valid, scale, bias = padded_batch()
    out = correct(x.double(), valid, scale.double(), bias.double(), 1e-5).float()
    assert diagnose_output(out * 1.37 + 0.2, x, valid, scale, bias, 1e-5) == []


def test_nan_gradient_from_poisoned_padding_is_explained():
    x, valid, scale, bias = padded_batch()
    leaves = [t.clone().requires_grad_() for t in (x, scale, bias)]
    one_liner = F.layer_norm(leaves[0], (32,), leaves[1], leaves[2]).masked_fill(
        ~valid[..., None], 0
    )
    (grad_scale,) = torch.autograd.grad(one_liner.sum(), leaves[1])
    assert grad_scale.isnan().any()
    reference = torch.ones_like(grad_scale)
    found = diagnose_nan_gradient("grad_scale", grad_scale, reference, x, valid)
    assert found is not None and found.mistake == "nan_from_padding"
    assert "grad_scale" in found.description and "x" in found.description
    # Without poison in the padding there is nothing to explain that way.
    clean = torch.where(valid[..., None], x, 0.0)
    assert diagnose_nan_gradient("grad_scale", grad_scale, reference, clean, valid) is None


# --- on rows where rounding is loud, and on gradients -------------------------------------------


def plain_float32(x, valid, eps=1e-5, unbiased=False, one_pass=False):
    """A float32 kernel written plainly (padding zeroed first), right or wrong in one way."""
    rows = torch.where(valid[..., None], x, 0.0)
    mean = rows.mean(-1, keepdim=True)
    if one_pass:
        var = (rows * rows).mean(-1, keepdim=True) - mean * mean
    else:
        var = (rows - mean).square().mean(-1, keepdim=True)
    if unbiased:
        var = var * x.shape[-1] / (x.shape[-1] - 1)
    out = (rows - mean) / torch.sqrt(var.clamp_min(0) + eps)
    return torch.where(valid[..., None], out, 0.0)


def mixed_rows(offset=0.0, seed=2):
    """float32 rows of 64 with means about N(offset, 1) and spreads from 1e-2 to 10."""
    generator = torch.Generator().manual_seed(seed)
    spread = 10 ** (3 * torch.rand(256, 1, generator=generator, dtype=torch.float64) - 2)
    mean = offset + torch.randn(256, 1, generator=generator, dtype=torch.float64)
    x = mean + spread * torch.randn(256, 64, generator=generator, dtype=torch.float64)
    return x.float(), torch.ones(256, dtype=torch.bool), torch.ones(64), torch.zeros(64)


def test_noise_lets_a_mistake_be_named_through_the_rounding_of_offset_rows():
    _, valid, scale, bias = offset_rows()
    x = (1e4 + torch.randn(64, 128, generator=torch.Generator().manual_seed(3))).float()
    unbiased = plain_float32(x, valid, unbiased=True)
    # float32 loses 3 to 4 digits at this offset: the mistake is there, under the noise.
    assert diagnose_output(unbiased, x, valid, scale, bias, 1e-5) == []
    truth = correct(x.double(), valid, scale.double(), bias.double(), 1e-5)
    noise = relative_distance(F.layer_norm(x, (128,)), truth)
    assert noise > 1e-4
    found = diagnose_output(unbiased, x, valid, scale, bias, 1e-5, noise=noise)
    assert [d.mistake for d in found] == ["unbiased_variance"]
    # and a correct kernel, with the same allowance, matches nothing
    assert diagnose_output(plain_float32(x, valid), x, valid, scale, bias, 1e-5, noise=noise) == []


def test_one_pass_variance_is_named_on_mixed_rows_and_an_unbiased_one_is_not():
    x, valid, scale, bias = mixed_rows()
    one_pass = plain_float32(x, valid, one_pass=True)
    assert [d.mistake for d in diagnose_output(one_pass, x, valid, scale, bias, 1e-5)] == [
        "one_pass_variance"
    ]
    assert diagnose_output(plain_float32(x, valid), x, valid, scale, bias, 1e-5) == []
    # Every row rescaled by the same factor is a formula mistake, not rounding.
    x, valid, scale, bias = offset_rows(offset=1e3)
    unbiased = plain_float32(x, valid, unbiased=True)
    truth = correct(x.double(), valid, scale.double(), bias.double(), 1e-5)
    noise = relative_distance(F.layer_norm(x, (128,)), truth)
    found = diagnose_output(unbiased, x, valid, scale, bias, 1e-5, noise=noise)
    assert [d.mistake for d in found] == ["unbiased_variance"]


GRADIENT_NEUTRAL = {"bias_missing", "bias_before_scale", "padding_returns_bias"}
"""Mistakes in how bias is added: the gradient w.r.t. x is the correct one."""


@pytest.mark.parametrize("name", list(MISTAKES))
def test_each_mistakes_gradient_is_recognized_as_itself_only(name):
    x, valid, scale, bias = padded_batch(spread=0.5)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    leaf = x.double().requires_grad_()
    wrong = MISTAKES[name].formula(leaf, valid, scale.double(), bias.double(), 1e-5)
    upstream = torch.where(valid[..., None], grad_out.double(), 0.0)
    (grad_x,) = torch.autograd.grad(wrong, leaf, upstream)
    found = diagnose_gradient(grad_x, x, valid, scale, bias, grad_out, 1e-5, torch.float64)
    assert [d.mistake for d in found] == ([] if name in GRADIENT_NEUTRAL else [name])


def test_a_correct_float32_gradient_matches_no_mistake():
    x, valid, scale, bias = padded_batch()
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    clean = torch.where(valid[..., None], x, 0.0).requires_grad_()
    out = F.layer_norm(clean, (32,), scale, bias).masked_fill(~valid[..., None], 0)
    (grad_x,) = torch.autograd.grad(out, clean, grad_out)
    assert diagnose_gradient(grad_x, x, valid, scale, bias, grad_out, 1e-5) == []


# --- the backward's mistakes (issue 37, 2) -----------------------------------------------------


def written_backward(x, valid, scale, grad_out, eps=1e-5, dtype=torch.float32, **wrong):
    """A hand-written backward in ``dtype`` (dx = rstd * (wdy - xhat * c1 - c2), the sums over
    valid rows), right or with one mistake: ``xhat_term=False``, ``mean_term=False``,
    ``unbiased=True``, ``padding=True`` (the padding's grad_out summed)."""
    keep = valid[..., None]
    rows = torch.where(keep, x, 0.0).to(dtype)
    mean = rows.mean(-1, keepdim=True)
    var = (rows - mean).square().mean(-1, keepdim=True)
    if wrong.get("unbiased"):
        var = rows.var(-1, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    xhat = (rows - mean) * rstd
    upstream = grad_out.to(dtype).nan_to_num(0.0, 0.0, 0.0)
    dy = torch.where(keep, upstream, 0.0)
    wdy = dy * scale.to(dtype)
    dx = wdy
    if wrong.get("xhat_term", True):
        dx = dx - xhat * (xhat * wdy).mean(-1, keepdim=True)
    if wrong.get("mean_term", True):
        dx = dx - wdy.mean(-1, keepdim=True)
    summed = upstream if wrong.get("padding") else dy
    grad_x = torch.where(keep, dx * rstd, 0.0)
    return grad_x, (summed * xhat).sum((0, 1)), summed.sum((0, 1))


BACKWARD = {
    "backward_missing_xhat_term": {"xhat_term": False},
    "backward_missing_mean_term": {"mean_term": False},
    "backward_unbiased_variance": {"unbiased": True},
    "padding_in_parameter_gradients": {"padding": True},
}
CHANGES = {
    "backward_missing_xhat_term": ("grad_x",),
    "backward_missing_mean_term": ("grad_x",),
    "backward_unbiased_variance": ("grad_x", "grad_scale"),
    "padding_in_parameter_gradients": ("grad_bias",),
}
"""The gradients each backward mistake changes (padding zeroed: the padding's xhat is 0)."""


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(BACKWARD))
def test_each_backward_mistake_is_recognized_as_itself_only(name, dtype):
    x, valid, scale, bias = padded_batch(spread=0.5)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    wrong = written_backward(x.double(), valid, scale.double(), grad_out, dtype=dtype,
                             **BACKWARD[name])  # fmt: skip
    for which, value in zip(("grad_x", "grad_scale", "grad_bias"), wrong, strict=True):
        found = diagnose_gradient(value, x, valid, scale, bias, grad_out, 1e-5, name=which)
        expected = {name} if which in CHANGES[name] else set()
        if name == "backward_unbiased_variance" and which == "grad_scale":
            expected.add("unbiased_variance")  # the same xhat: only out tells them apart
        assert {d.mistake for d in found} == expected, which


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_correct_hand_written_backward_matches_no_mistake(dtype):
    x, valid, scale, bias = padded_batch()
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(8))
    right = written_backward(x.double(), valid, scale.double(), grad_out, dtype=torch.float32)
    for which, value in zip(("grad_x", "grad_scale", "grad_bias"), right, strict=True):
        found = diagnose_gradient(value.to(dtype), x, valid, scale, bias, grad_out, 1e-5,
                                  name=which)  # fmt: skip
        assert found == [], which


def test_statistics_overflowing_float16_are_told_from_rounding_and_from_a_padding_leak():
    x, valid, _, _ = padded_batch(spread=300.0)
    one, zero = torch.ones(32, dtype=torch.float64), torch.zeros(32, dtype=torch.float64)
    truth = correct(x.double(), valid, one, zero, 1e-5)
    rows = torch.where(valid[..., None], x, 0.0).half()
    mean = rows.mean(-1, keepdim=True)
    var = (rows - mean).square().mean(-1, keepdim=True)  # inf: squares beyond 65,504
    out = torch.where(valid[..., None], (rows - mean) * torch.rsqrt(var + 1e-5), 0.0)
    found = overflow_match(out, truth, x, valid, torch.float16)
    assert found is not None and found.mistake == "statistics_overflow"
    # Not in bfloat16 (float32's range), nor for a correct float16 kernel, nor for rows that
    # hold the statistics (x of spread 1)
    assert overflow_match(out, truth, x, valid, torch.bfloat16) is None
    right = F.layer_norm(rows.float(), (32,)).half()
    right = torch.where(valid[..., None], right, 0.0)
    assert overflow_match(right, truth, x, valid, torch.float16) is None
    small, _, _, _ = padded_batch(spread=0.5)
    assert overflow_match(out, truth, small, valid, torch.float16) is None
