"""The error budget's model for RMSNorm (issue 39): ``RowBudget(..., centered=False)``.

Calibrated as LayerNorm's was: correct RMSNorm kernels (a sequential float32 sum, a
float64-accumulating one, half dtypes computed in float32, a two-pass one scaling the row by
its largest magnitude first) in float32, float64, float16 and bfloat16 need at most 1.5 times
the model on hard rows (huge and tiny magnitudes, long rows, heavy tails, one channel, constant
rows, tiny gradients), against a float64 truth written here; the usual wrong ones need at
least 6 (verify's default factor is 3). Here the model alone is judged (no yardstick raising
it, as benchmarks/verify_calibration.py measures LayerNorm's). verify judges RMSNorm problems
with this model (``--norm rms``); tests/verify/test_verify_rms.py checks that end to end.
"""

from __future__ import annotations

import pytest
import torch

from maskln_cli.verify import budget
from maskln_cli.verify.budget import Precision, RowBudget, SumBudget

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MAGNITUDE = {torch.float16: (3, -3)}
"""Decades of 'huge' and 'tiny' rows: within what a correct kernel squares in its compute dtype
(float32's squares overflow above 1.8e19: a float32 kernel squaring 1e30 is wrong there)."""


def hard_rows(dtype, channels, seed=0):
    """[R, C] in float64 holding values of ``dtype``: normal, huge, tiny, heavy-tailed, constant
    rows and an offset one (nothing is subtracted, so no harder), and a padded row of NaN."""
    generator = torch.Generator().manual_seed(seed)
    huge, tiny = _MAGNITUDE.get(dtype, (15, -15))

    def normal():
        return torch.randn(channels, generator=generator, dtype=torch.float64)

    exponents = torch.rand(channels, generator=generator, dtype=torch.float64) * 6 - 3
    rows = [
        normal(),
        normal() * 10.0**huge,
        normal() * 10.0**tiny,
        normal().sign() * 10.0**exponents,
        torch.full((channels,), 3.0, dtype=torch.float64),
        normal() + 100.0,
        normal() * 1e-3,  # mean(x**2) of 1e-6: where eps (1e-6) matters
        torch.full((channels,), float("nan"), dtype=torch.float64),
    ]
    x = torch.stack(rows).to(dtype).double()
    valid = torch.ones(len(rows), dtype=torch.bool)
    valid[-1] = False
    return x, valid


def truth_of(x, valid, weight, eps, dy):
    """out, grad_x, grad_scale of RMSNorm in float64 by autograd through plain ops."""
    x = torch.where(valid[:, None], x, 0.0).requires_grad_()
    w = weight.clone().requires_grad_()
    out = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w
    out = torch.where(valid[:, None], out, 0.0)
    grad_x, grad_scale = torch.autograd.grad(out, (x, w), dy)
    return out.detach(), grad_x, grad_scale


def kernel(kind):
    """An RMSNorm forward and backward as a kernel author writes it: ``(x, valid, w, eps, dy)``
    in the judged dtype -> (out, grad_x, grad_scale) in it."""

    def run(x, valid, w, eps, dy):
        dtype = x.dtype
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        if kind == "half accumulation":
            compute = dtype
        rows = torch.where(valid[:, None], x, 0).to(compute)
        gain, up = w.to(compute), torch.where(valid[:, None], dy, 0).to(compute)
        channels = x.shape[-1]
        if kind == "sequential float32":  # a plain loop's sum, element by element
            squares = rows.square().cumsum(-1)[:, -1:] / channels
        elif kind == "half accumulation":  # each partial sum rounded to the half dtype
            total = torch.zeros(rows.shape[0], 1, dtype=compute)
            for column in rows.square().unbind(-1):
                total = total + column[:, None]
            squares = total / channels
        elif kind == "float64 accumulation":
            squares = rows.double().square().mean(-1, keepdim=True).to(compute)
        elif kind == "two-pass scaled":  # by the row's largest magnitude first
            largest = rows.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(compute).tiny)
            squares = (rows / largest).square().mean(-1, keepdim=True) * largest.square()
        elif kind == "variance over C-1":
            squares = rows.square().sum(-1, keepdim=True) / max(channels - 1, 1)
        elif kind == "mean subtracted":
            rows = rows - rows.mean(-1, keepdim=True)
            squares = rows.square().mean(-1, keepdim=True)
        else:
            squares = rows.square().mean(-1, keepdim=True)
        if kind == "eps outside the sqrt":
            rstd = 1 / (squares.sqrt() + eps)
        else:
            rstd = torch.rsqrt(squares + eps)
        if kind == "1 + scale":
            gain = 1 + gain
        xhat = rows * rstd
        out = xhat * gain
        wdy = up * gain
        c1 = (xhat * wdy).mean(-1, keepdim=True)
        grad_x = rstd * (wdy - xhat * c1)
        grad_scale = (up * xhat).sum(0)
        keep = valid[:, None]
        return (
            torch.where(keep, out, 0).to(dtype),
            torch.where(keep, grad_x, 0).to(dtype),
            grad_scale.to(dtype),
        )

    return run


CORRECT = ("pairwise float32", "sequential float32", "float64 accumulation", "two-pass scaled")
WRONG = (
    "mean subtracted", "eps outside the sqrt", "1 + scale", "half accumulation",
    "variance over C-1",
)  # fmt: skip


def factors(kind, dtype, channels, eps=1e-6, upstream=1.0):
    """The factor of the model each of out, grad_x and grad_scale needs (beyond 2 ulps, and
    with ``strict`` False beyond assert_close's default rtol and atol too)."""
    x64, valid = hard_rows(dtype, channels)
    generator = torch.Generator().manual_seed(1)
    weight = 1 + 0.5 * torch.randn(channels, generator=generator, dtype=torch.float64)
    weight = weight.to(dtype).double()
    dy = upstream * torch.randn(x64.shape, generator=generator, dtype=torch.float64)
    dy = dy.to(dtype).double()
    truth = truth_of(x64, valid, weight, eps, dy)
    results = kernel(kind)(x64.to(dtype), valid, weight.to(dtype), eps, dy.to(dtype))
    rows = RowBudget(x64, valid, weight, torch.zeros_like(weight), eps, Precision.of(dtype),
                     centered=False)  # fmt: skip
    sums = rows.share_of_sums(dy)
    models = (rows.out(truth[0]), rows.grad_x(dy), sums.grad_scale(truth[2]))
    needed = []
    for result, true, model in zip(results, truth, models, strict=True):
        error = (result.double() - true).abs()
        always = budget.floor(true, dtype, 0.0, 0.0)
        needed.append(budget.factor_needed(error, model, always))
    return needed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", CORRECT)
@pytest.mark.parametrize("channels", [1, 64, 4096])
def test_correct_kernels_need_at_most_one_and_a_half_of_the_model(kind, dtype, channels):
    for upstream in (1.0, 1e-30 if dtype != torch.float16 else 1e-4):  # tiny gradients too
        needed = factors(kind, dtype, channels, upstream=upstream)
        assert max(needed) <= 1.5, (needed, upstream)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", WRONG)
def test_wrong_kernels_need_at_least_six_times_the_model(kind, dtype):
    if kind == "half accumulation" and dtype in (torch.float32, torch.float64):
        pytest.skip("accumulating in float32 or float64 is not a mistake")
    channels = 8 if kind == "variance over C-1" else 1024
    needed = factors(kind, dtype, channels)
    assert max(needed) >= 6, needed


def test_the_rms_model_has_no_mean_term():
    """A row of mean 1e4 and spread 1: LayerNorm's model grows with mean / std (the mean's
    rounding); RMSNorm's, subtracting nothing, does not."""
    generator = torch.Generator().manual_seed(0)
    x = 1e4 + torch.randn(4, 64, generator=generator, dtype=torch.float64)
    valid = torch.ones(4, dtype=torch.bool)
    one, zero = torch.ones(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
    precision = Precision.of(torch.float32)
    layer = RowBudget(x, valid, one, zero, 1e-6, precision).out()
    rms = RowBudget(x, valid, one, zero, 1e-6, precision, centered=False).out()
    assert float(rms.max()) < 1e-5 < float(layer.max())
    assert isinstance(SumBudget(64, precision), SumBudget)
