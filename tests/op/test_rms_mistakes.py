"""RMSNorm's known-mistake catalogue (``norm="rms"``): each mistake's output, and its gradient
by autograd, is recognized as that mistake and as no other; correct RMSNorm results (torch's
``F.rms_norm`` in float32 included) match none, nor does a correct LayerNorm's (a LayerNorm
is RMSNorm's mistake, matched only when RMSNorm is due)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from maskln_cli.op.mistakes import CATALOGUES, correct, diagnose_gradient, diagnose_output
from maskln_cli.op.rms_mistakes import RMS_MISTAKES, rms_correct


def padded_batch(dtype=torch.float32, seed=0):
    """RMSNorm's inputs as verify holds them: ``scale`` the whole gain, ``bias`` zeros."""
    generator = torch.Generator().manual_seed(seed)
    x = (1 + 2 * torch.randn(8, 16, 32, generator=generator, dtype=torch.float64)).to(dtype)
    valid = torch.rand(8, 16, generator=generator) < 0.7
    x[~valid] = math.nan
    gain = (1 + 0.3 * torch.randn(32, generator=generator, dtype=torch.float64)).to(dtype)
    return x, valid, gain, torch.zeros(32, dtype=dtype)


def truth(x, valid, gain, eps):
    """RMSNorm in float64, written here from the definition."""
    rows = torch.where(valid[..., None], x.double(), 0.0)
    out = rows / torch.sqrt(rows.square().mean(-1, keepdim=True) + eps) * gain.double()
    return torch.where(valid[..., None], out, 0.0)


def test_the_catalogue_is_chosen_by_the_norm():
    assert CATALOGUES["rms"].mistakes is RMS_MISTAKES and not CATALOGUES["rms"].fitted
    x, valid, gain, bias = padded_batch(torch.float64)
    assert torch.equal(rms_correct(x, valid, gain, bias, 1e-6), truth(x, valid, gain, 1e-6))


@pytest.mark.parametrize("name", list(RMS_MISTAKES))
@pytest.mark.parametrize("eps", [1e-2, 3.0])  # where eps outside the sqrt shows
def test_each_mistake_is_recognized_as_itself_only(name, eps):
    x, valid, gain, bias = padded_batch()
    wrong = RMS_MISTAKES[name].formula(x.double(), valid, gain.double(), bias.double(), eps)
    assert relative_to_truth(wrong, x, valid, gain, eps) > 1e-3  # a mistake, not the truth
    found = diagnose_output(wrong.float(), x, valid, gain, bias, eps, norm="rms")
    assert [d.mistake for d in found] == [name]
    assert found[0].description and found[0].fix


def relative_to_truth(result, x, valid, gain, eps):
    reference = truth(x, valid, gain, eps)
    if not torch.equal(result.isfinite(), reference.isfinite()):
        return math.inf  # NaN where the truth is a number (the padding normalized)
    both = result.isfinite()
    return float((result[both] - reference[both]).norm() / reference[both].norm())


@pytest.mark.parametrize("name", [n for n in RMS_MISTAKES if not n.startswith(("padding", "mask"))])
def test_each_mistakes_gradient_is_recognized_as_itself_only(name):
    x, valid, gain, bias = padded_batch(torch.float64)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    leaf = torch.where(valid[..., None], x, 0.0).requires_grad_()
    wrong = RMS_MISTAKES[name].formula(leaf, valid, gain, bias, 1e-2)
    (grad_x,) = torch.autograd.grad(wrong, leaf, dy)
    found = diagnose_gradient(grad_x.float(), x, valid, gain, bias, dy, 1e-2, norm="rms")
    assert [d.mistake for d in found] == [name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_correct_results_match_no_mistake(dtype):
    x, valid, gain, bias = padded_batch(dtype)
    out = truth(x, valid, gain, 1e-6).to(dtype)
    assert diagnose_output(out, x, valid, gain, bias, 1e-6, norm="rms") == []
    clean = torch.where(valid[..., None], x, 0.0)
    torch_out = F.rms_norm(clean, (32,), gain, 1e-6).masked_fill(~valid[..., None], 0)
    assert diagnose_output(torch_out, x, valid, gain, bias, 1e-6, norm="rms") == []


def test_a_layer_norm_is_rms_norms_mistake_and_not_layer_norms():
    x, valid, gain, bias = padded_batch(torch.float64)
    layer = correct(x, valid, gain, bias, 1e-6)
    assert diagnose_output(layer, x, valid, gain, bias, 1e-6) == []
    named = diagnose_output(layer, x, valid, gain, bias, 1e-6, norm="rms")
    assert [d.mistake for d in named] == ["mean_subtracted"]


def test_the_backward_without_its_xhat_term_is_recognized_in_grad_x_only():
    """rstd's own gradient dropped: dx = rstd * scale * dy, against autograd's of the truth."""
    from maskln_cli.op.rms_mistakes import RMS_BACKWARD_MISTAKES

    x, valid, gain, bias = padded_batch(torch.float64)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    rows = torch.where(valid[..., None], x, 0.0)
    rstd = torch.rsqrt(rows.square().mean(-1, keepdim=True) + 1e-6)
    wrong = torch.where(valid[..., None], rstd * gain * dy, 0.0)
    found = diagnose_gradient(wrong.float(), x, valid, gain, bias, dy, 1e-6, norm="rms")
    assert (
        [d.mistake for d in found] == list(RMS_BACKWARD_MISTAKES) == ["backward_missing_xhat_term"]
    )
    leaf = rows.clone().requires_grad_()
    (right,) = torch.autograd.grad(truth(leaf, valid, gain, 1e-6), leaf, dy)
    assert diagnose_gradient(right.float(), x, valid, gain, bias, dy, 1e-6, norm="rms") == []
