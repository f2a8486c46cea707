"""Correct backward passes on offset rows (issue 37, section 3): at x = 1e4 + 0.1 * N(0, 1) in
float32 (C = 64, NaN and inf padding, scale = 1 + 0.1 * N(0, 1)) every correct kernel (torch's,
autograd through a two-pass formula, a sequential sum's loop and Welford's, hand-written backward
in both forms with pairwise or sequential sums, Welford's final mean with a hand-written
backward) passes within 1.0 of grad_x's model, and on the other families: the bound any
tightening of that model must keep.

Two wrong backward passes stay within the budget there (docs/verify-budget.md, "The gradients'
budget"): ``c2 = mean(dy)`` (1.98 of the model) and ``c1 = mean(xhat * dy)`` (1.27); the
measurements there say why no term of the model is loose enough to fail them.
"""

from __future__ import annotations

import math

import pytest
import torch

from maskln_cli.testing import verify
from tests import kernels

EPS = 1e-5


def offset_rows(seed: int = 0) -> kernels.Tensors:
    """[4, 64, 64] float32 rows of 1e4 + 0.1 * N(0, 1), about 30 % of them padding holding NaN,
    inf and -inf (its upstream gradient NaN), scale 1 + 0.1 * N(0, 1), bias 0.1 * N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    batch, length, channels = 4, 64, 64
    x = 1e4 + 0.1 * torch.randn(batch, length, channels, generator=g, dtype=torch.float64)
    valid = torch.ones(batch, length, dtype=torch.bool)
    for b in range(batch):
        valid[b, length - (round(length * 0.3) + b % 3 - 1) :] = False
    poison = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float64)
    x[~valid] = poison[torch.arange(channels) % 3]
    scale = 1 + 0.1 * torch.randn(channels, generator=g, dtype=torch.float64)
    bias = 0.1 * torch.randn(channels, generator=g, dtype=torch.float64)
    grad_out = torch.randn(batch, length, channels, generator=g, dtype=torch.float64)
    grad_out[~valid] = math.nan
    tensors = {"x": x, "scale": scale, "bias": bias, "grad_out": grad_out}
    return {k: v.float() for k, v in tensors.items()} | {"valid": valid}


def hand_written(welford: bool = False):
    """A float32 kernel with a hand-written backward, ``dx = rstd * (wdy - xhat * c1 - c2)``:
    its mean a two-pass one (torch's sum) or Welford's final running mean."""

    def kernel(inputs: kernels.Tensors) -> kernels.Tensors:
        keep = inputs["valid"][..., None]
        rows = torch.where(keep, inputs["x"], 0.0)
        scale, bias = inputs["scale"], inputs["bias"]
        if welford:
            mean, var = kernels.welford_statistics(rows)
        else:
            mean = rows.mean(-1, keepdim=True)
            var = (rows - mean).square().mean(-1, keepdim=True)
        rstd = torch.rsqrt(var + EPS)
        xhat = (rows - mean) * rstd
        dy = torch.where(keep, inputs["grad_out"], 0.0)
        wdy = dy * scale
        c1 = (xhat * wdy).mean(-1, keepdim=True)
        c2 = wdy.mean(-1, keepdim=True)
        return {
            "out": torch.where(keep, xhat * scale + bias, 0.0),
            "grad_x": torch.where(keep, rstd * (wdy - xhat * c1 - c2), 0.0),
            "grad_scale": (dy * xhat).sum((0, 1)),
            "grad_bias": dy.sum((0, 1)),
        }

    return kernel


def autograd(kernel: kernels.Kernel):
    return lambda inputs: kernels.run(kernel, inputs)


CORRECT = {
    "F.layer_norm": autograd(kernels.torch_layer_norm),
    "two-pass (autograd)": autograd(kernels.two_pass),
    "Welford (autograd)": autograd(kernels.welford),
    "sequential (autograd)": autograd(kernels.sequential),
    **{name: autograd(k) for name, k in kernels.BACKWARD_CORRECT.items()},
    "hand-written, Welford's mean": hand_written(welford=True),
    "hand-written": hand_written(),
}


def judge(result: kernels.Tensors, inputs: kernels.Tensors) -> tuple[bool, dict]:
    report = verify(
        result["out"], inputs["x"], inputs["valid"], inputs["scale"], inputs["bias"], EPS,
        grad_out=inputs["grad_out"], grad_x=result["grad_x"],
        grad_scale=result["grad_scale"], grad_bias=result["grad_bias"],
    )  # fmt: skip
    return report.passed, {t.name: t.to_dict() for t in report.tensors}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kernel", list(CORRECT))
def test_correct_kernels_pass_on_offset_rows(kernel, seed):
    inputs = offset_rows(seed)
    passed, tensors = judge(CORRECT[kernel](inputs), inputs)
    assert passed, {n: t["problems"] for n, t in tensors.items()}
    assert tensors["grad_x"]["factor_needed"] <= 1.0


OTHER_FAMILIES = ["N(0, 1)", "offset 1e3", "1e4 + N(0, 0.1)", "spread 1e-2..10", "heavy tails"]


@pytest.mark.parametrize("family", OTHER_FAMILIES)
@pytest.mark.parametrize(
    "kernel", ["F.layer_norm", "Welford (autograd)", "written, torch's form, sequential sums"]
)
def test_correct_kernels_pass_on_the_other_families(kernel, family):
    inputs = kernels.DATA_FAMILIES[family](0)
    passed, tensors = judge(CORRECT[kernel](inputs), inputs)
    assert passed, {n: t["problems"] for n, t in tensors.items()}
    assert tensors["grad_x"]["factor_needed"] <= 1.0


def mean_term_unscaled(inputs: kernels.Tensors) -> kernels.Tensors:
    """A wrong backward: its mean term sums the upstream gradient without scale, ``c2 =
    mean(dy)`` (the correct one is ``mean(scale * dy)``), otherwise :func:`hand_written`'s."""
    result = hand_written()(inputs)
    keep = inputs["valid"][..., None]
    rows = torch.where(keep, inputs["x"], 0.0)
    mean = rows.mean(-1, keepdim=True)
    rstd = torch.rsqrt((rows - mean).square().mean(-1, keepdim=True) + EPS)
    dy = torch.where(keep, inputs["grad_out"], 0.0)
    wrong = dy.mean(-1, keepdim=True) - (dy * inputs["scale"]).mean(-1, keepdim=True)
    return result | {"grad_x": torch.where(keep, result["grad_x"] - rstd * wrong, 0.0)}


@pytest.mark.parametrize("seed", [0, 1])
def test_a_mean_term_summed_without_scale_fails_on_offset_rows(seed):
    """Its error is a constant on each row, of a random sign from row to row (no pooled factor
    sees it), within the per-element budget (1.98 of it), but beyond each row's rounding of
    its constant."""
    inputs = offset_rows(seed)
    passed, tensors = judge(mean_term_unscaled(inputs), inputs)
    assert not passed
    problems = " ".join(tensors["grad_x"]["problems"])
    assert "mean error on each row beyond that row's rounding" in problems, problems


@pytest.mark.parametrize("seed", [0, 1])
def test_correct_float16_kernels_pass_on_wide_rows_of_tiny_gradients(seed):
    """At C = 4096 and an upstream gradient of 1e-6, a float16 grad_x is made of subnormals:
    rounding each to the nearest multiple of 2**-24 moves a row's mean by up to half of it
    alike, far beyond its rounding in a normal float16 (F.layer_norm's constants were 0.26 to
    0.34 of their bounds, beyond the limit 0.25: a false failure)."""
    inputs = kernels.offset_batch(0.0, seed, shape=(1, 32, 4096), dtype="float16")
    inputs["grad_out"] = (inputs["grad_out"].double() * 1e-6).half()
    passed, tensors = judge(kernels.run(kernels.torch_layer_norm, inputs), inputs)
    assert passed, {n: t["problems"] for n, t in tensors.items()}


def xhat_term_unscaled(inputs: kernels.Tensors) -> kernels.Tensors:
    """A wrong backward: its xhat term sums the upstream gradient without scale, ``c1 =
    mean(xhat * dy)`` (the correct one is ``mean(xhat * scale * dy)``), otherwise
    :func:`hand_written`'s."""
    result = hand_written()(inputs)
    keep = inputs["valid"][..., None]
    rows = torch.where(keep, inputs["x"], 0.0)
    mean = rows.mean(-1, keepdim=True)
    rstd = torch.rsqrt((rows - mean).square().mean(-1, keepdim=True) + EPS)
    xhat = (rows - mean) * rstd
    dy = torch.where(keep, inputs["grad_out"], 0.0)
    wrong = (xhat * dy).mean(-1, keepdim=True) - (xhat * dy * inputs["scale"]).mean(-1, True)
    return result | {"grad_x": torch.where(keep, result["grad_x"] - rstd * xhat * wrong, 0.0)}


@pytest.mark.xfail(
    strict=True,
    reason="issue 37: its slope along xhat per row (0.30 of a rounding bound here) is what "
    "torch's CPU form with sequential sums reaches with dy of one sign (0.30 at C = 768): "
    "docs/verify-budget.md",
)
def test_an_xhat_term_summed_without_scale_fails_on_offset_rows():
    """Its error is a slope along xhat on each row, of a random sign from row to row (no
    pooled coefficient sees it), within the per-element budget (1.27 of it)."""
    inputs = offset_rows(0)
    passed, _ = judge(xhat_term_unscaled(inputs), inputs)
    assert not passed
