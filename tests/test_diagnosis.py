"""The known-mistake catalogue: each mistake's output is recognized as that mistake, and as no
other; correct results (in float32 too, torch's own included) match none."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from maskln_cli.diagnosis import MISTAKES, correct, diagnose_nan_gradient, diagnose_output


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
