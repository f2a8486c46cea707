"""Words that said what was not true or not plainly (issue 37's leftovers): "all 57 elements"
of a 64-element grad_scale, "scaled by 1 - 0.86", and RMSNorm's overflow said to leave a
row "its bias" (RMSNorm has none)."""

from __future__ import annotations

import torch

from maskln_cli.testing import verify
from maskln_cli.verify.systematic import Finding
from tests.verify.test_rms_diagnosis import wrong_kernel


def _finding(rows, factor, unit="rows", of=None, **more):
    return Finding(
        rows=rows, factor=factor, factor_error=abs(factor) / 1000, shift=0.0, shift_error=0.0,
        gate=0.0, systematic_factor=True, systematic_shift=False, unit=unit, of=of, **more,
    )  # fmt: skip


def test_a_large_factor_is_printed_plainly():
    sentence = _finding(200, -0.86).sentence()
    assert "scaled by 0.14 ±" in sentence and "1 - 0.86" not in sentence, sentence
    assert "scaled by 1.5 ±" in _finding(200, 0.5).sentence()
    # a small one keeps its digits: 0.9999955 would hide them
    assert "scaled by 1 - 4.5e-06 ±" in _finding(922, -4.5e-6).sentence()


def test_a_row_beyond_its_bound_is_printed_plainly_too():
    finding = _finding(6, -0.86, rows_beyond=1, row=[0, 5], row_factor=-0.86, row_limit=0.004)
    finding.systematic_factor = False
    assert "row [0, 5] scaled by 0.14," in finding.sentence(), finding.sentence()


def test_elements_regressed_are_said_of_the_tensors_elements():
    sentence = _finding(57, 0.0083, unit="elements", of=64).sentence()
    assert sentence.startswith("57 of 64 elements scaled by"), sentence
    assert _finding(64, 0.0083, unit="elements", of=64).sentence().startswith("all 64 elements")


def test_a_verify_of_grad_scale_says_how_many_of_its_elements():
    """The Explainer gives the finding the tensor's element count."""
    from tests.verify.test_rms_diagnosis import judged

    report = judged("half accumulation", "outliers", torch.float16)
    grad_scale = next(t for t in report.tensors if t.name == "grad_scale")
    (line,) = [p for p in grad_scale.problems if "elements scaled by" in p]
    regressed = grad_scale.systematic["rows"]
    assert regressed < grad_scale.numel  # the case: not every element was regressed
    assert line.startswith(f"{regressed:,} of {grad_scale.numel:,} elements scaled by"), line


def test_rms_statistics_overflow_says_no_bias():
    g = torch.Generator().manual_seed(0)
    channels = 256
    x = (300 * torch.randn(4, 8, channels, generator=g, dtype=torch.float64)).to(torch.float16)
    valid = torch.ones(4, 8, dtype=torch.bool)
    valid[:, 6:] = False
    weight = torch.ones(channels, dtype=torch.float16)
    dy = torch.randn(4, 8, channels, generator=g).to(torch.float16)
    run = wrong_kernel("half accumulation")
    flat = (x.reshape(-1, channels), valid.reshape(-1), weight, 1e-6, dy.reshape(-1, channels))
    out, grad_x, grad_scale = run(*flat)
    report = verify(
        out.reshape(x.shape), x, valid, weight, None, 1e-6, grad_out=dy,
        grad_x=grad_x.reshape(x.shape), grad_scale=grad_scale, norm="rms",
    )  # fmt: skip
    named = [d for t in report.tensors for d in t.diagnosis]
    assert {d["mistake"] for d in named} == {"statistics_overflow"}
    for d in named:  # RMSNorm's row is 0 there: said, and no bias of its own
        assert "its bias" not in d["description"] and "RMSNorm's 0" in d["description"]


def _layer_norm_with_grad_scale(grad_scale_of):
    """maskln's out, grad_x and grad_bias on padded N(0, 1) rows ``[4, 32, 64]``, and
    grad_scale as ``grad_scale_of`` makes it from xhat (0 in the padding) and grad_out."""
    from maskln_cli import masked_layer_normalization

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, 64, generator=g)
    valid = torch.rand(4, 32, generator=g) > 0.3
    scale, bias = 1 + 0.5 * torch.randn(64, generator=g), 0.3 * torch.randn(64, generator=g)
    dy = torch.randn(4, 32, 64, generator=g)
    leaves = [t.clone().requires_grad_() for t in (x, scale, bias)]
    out = masked_layer_normalization(leaves[0], valid, leaves[1], leaves[2], 1e-5)
    grad_x, _, grad_bias = torch.autograd.grad(out, leaves, dy)
    xhat = torch.nn.functional.layer_norm(x.double(), (64,), eps=1e-5) * valid[..., None]
    grad_scale = grad_scale_of(xhat, dy.double() * valid[..., None]).float()
    return verify(
        out.detach(), x, valid, scale, bias, 1e-5, grad_out=dy, grad_x=grad_x,
        grad_scale=grad_scale, grad_bias=grad_bias,
    )  # fmt: skip


def test_a_sum_that_is_no_multiple_of_the_truth_is_not_said_scaled():
    """grad_scale summing each row's grad_out with the previous row's xhat is unrelated to the
    truth: it was said "61 of 64 elements scaled by -0.156 ± 0.1" (a new user's trial). Its
    elements' ratios to the truth spread by more than the multiple named: no scaling."""
    report = _layer_norm_with_grad_scale(lambda xhat, dy: (dy * xhat.roll(1, dims=1)).sum((0, 1)))
    assert not report.passed
    (grad_scale,) = [t for t in report.tensors if t.name == "grad_scale"]
    assert not any("scaled by" in p for p in grad_scale.problems), grad_scale.problems
    assert any("no multiple of the truth" in p for p in grad_scale.problems), grad_scale.problems
    # A sum really scaled is still said so.
    report = _layer_norm_with_grad_scale(lambda xhat, dy: 0.97 * (dy * xhat).sum((0, 1)))
    (grad_scale,) = [t for t in report.tensors if t.name == "grad_scale"]
    said = [p for p in grad_scale.problems if "elements scaled by 1 - 0.03 ±" in p]
    assert said, grad_scale.problems


def test_rows_off_by_their_bias_are_not_said_shifted():
    """out with the bias added twice is off by the bias, channel by channel: it was said "all
    89 valid rows shifted by -0.069" (the bias's mean, 5% of the error). A shift is said only
    where it is most of the error; an output really shifted still is."""
    from maskln_cli import masked_layer_normalization

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, 64, generator=g)
    valid = torch.rand(4, 32, generator=g) > 0.3
    scale, bias = 1 + 0.5 * torch.randn(64, generator=g), 0.3 * torch.randn(64, generator=g)
    right = masked_layer_normalization(x, valid, scale, bias, 1e-5)
    for wrong, said in ((right + bias * valid[..., None], "by no common factor or shift"),
                        (right + 0.01 * valid[..., None], "shifted by +0.01")):  # fmt: skip
        report = verify(wrong, x, valid, scale, bias, 1e-5)
        assert not report.passed
        problems = report.tensors[0].problems
        assert any(said in p for p in problems), problems
        if "no common" in said:
            assert not any("shifted by" in p for p in problems), problems


def test_rms_rows_about_an_offset_scaled_are_said_scaled():
    """RMSNorm rows about an offset (-2 + 0.004 N(0, 1)) with a gain 3% too large: the factor
    is the whole error, measured against the rows' energy (their truth is about -scale on every
    element), not against their small spread, where it was "by no common factor or shift (the
    factor 1 + 0.029 is 1% of the error)"."""
    g = torch.Generator().manual_seed(123)
    x = (-2.0 + 0.004 * torch.randn(16, 128, generator=g, dtype=torch.float64)).to(torch.bfloat16)
    valid, scale = torch.ones(16, dtype=torch.bool), 1 + 0.1 * torch.randn(128, generator=g)
    x64 = x.double()
    out = x64 / torch.sqrt(x64.square().mean(-1, keepdim=True) + 1e-6) * scale.double() * 1.03
    report = verify(out.to(torch.bfloat16), x, valid, scale, None, 1e-6, norm="rms")
    problems = report.tensors[0].problems
    assert any("valid rows scaled by 1 + 0.029" in p for p in problems), problems


def test_a_sum_over_few_rows_is_not_said_to_have_its_elements_as_rows():
    """grad_scale over 6 valid rows of 32 channels said "with 31 valid rows" (the elements
    regressed) in its not-checked line."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    x, scale, bias = (
        torch.randn(6, 32, generator=g),
        torch.randn(32, generator=g),
        torch.randn(32, generator=g),
    )
    grad_out = torch.randn(6, 32, generator=g)
    leaves = [t.clone().requires_grad_() for t in (x, scale, bias)]
    out = F.layer_norm(leaves[0], (32,), leaves[1], leaves[2], 1e-5)
    grads = torch.autograd.grad(out, leaves, grad_out)
    report = verify(
        out.detach(), x, torch.ones(6, dtype=torch.bool), scale, bias, 1e-5, grad_out=grad_out,
        grad_x=grads[0], grad_scale=grads[1], grad_bias=grads[2],
    )  # fmt: skip
    lines = {line.split(":")[0]: line for line in report.context["not_checked"]}
    assert "with 6 valid rows" in lines["out"]
    for name in ("grad_scale", "grad_bias"):
        assert "summed over fewer than 8 distinct valid rows" in lines[name], lines[name]


def test_a_mean_error_on_one_row_is_not_said_of_every_row():
    """grad_x's mean error beyond one row's rounding (a backward wrong on its middle row only):
    before, "all 57 valid rows: ... 1 rows beyond it", as if every row were wrong."""
    from maskln_cli.verify.terms import TermFinding

    terms = TermFinding(
        rows=57, xhat_term=0.0, xhat_term_error=1e-3, mean_term=0.0, mean_term_error=1e-3,
        systematic_xhat_term=False, systematic_mean_term=False, gate=1e-3, constant_score=2.1,
        constant_worst=15.0, constant_beyond=1, constant_rows=57, systematic_constant=True,
    )  # fmt: skip
    finding = _finding(57, 1e-9, terms=terms)
    finding.systematic_factor = False
    sentence = finding.sentence()
    assert not sentence.startswith("all"), sentence
    assert sentence.startswith("57 valid rows:"), sentence
    assert "1 row beyond it" in sentence and "1 rows" not in sentence, sentence
    assert "mean error on each row beyond that row's rounding" in sentence
