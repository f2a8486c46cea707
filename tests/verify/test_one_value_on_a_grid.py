"""A coarser dtype's rounding is named only where what the kernel computed lies on that dtype's
grid at many distinct points: a formula mistake that gives every row the same statistic (out
multiplied by 1.01 at eps 1: each row's variance times C recovered as about -5) lands all its
rows on one number, and that number on a bfloat16 grid point by chance: this float32 kernel,
computing in float32 throughout, was named "bfloat16 rounding" in 2 of 20 draws (found by a hunt
for wrong causes). eps ten times too large on nearly constant float32 rows, named "float16
rounding" in 4 of 20 draws, is another coincidence, not fixed: its xhat values are on float16's
grid (x's grid times an rstd of exactly 100)."""

from __future__ import annotations

import pytest
import torch

from tests import kernels


def formula(eps_factor: float, out_factor: float):
    def kernel(x, valid, scale, bias, eps):
        rows = torch.where(valid[:, None], x, 0.0)
        mean = rows.mean(-1, keepdim=True)
        var = (rows - mean).square().mean(-1, keepdim=True)
        out = ((rows - mean) * torch.rsqrt(var + eps_factor * eps) * scale + bias) * out_factor
        return torch.where(valid[:, None], out, 0.0)

    return kernel


def draw(family: str, seed: int, channels: int):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    uniform = lambda *shape: torch.rand(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    x, scale = rand(24, channels), rand(channels)
    bias, grad_out = rand(channels), rand(24, channels)
    eps = 1e-5
    if family == "nearly constant rows":
        x = 3.0 + 1e-4 * rand(24, channels) * 10 ** (-4 * uniform(24, 1))
    else:  # small rows at eps 1
        eps, x = 1.0, x * 1e-3
    valid = uniform(24) >= 0.2
    return [t.float() for t in (x, scale, bias, grad_out)], valid, eps


def judged_causes(family, channels, kernel, seed):
    (x, scale, bias, grad_out), valid, eps = draw(family, seed, channels)
    report = kernels.verified(kernel, x, valid, scale, bias, eps, grad_out)
    assert not report.passed
    return {d["mistake"] for t in report.tensors if not t.passed for d in t.diagnosis}


@pytest.mark.parametrize("seed", range(20))
def test_a_float32_formula_mistake_is_no_coarser_rounding(seed):
    named = judged_causes("small rows at eps 1", 5, formula(1.0, 1.01), seed)
    assert not any(cause.startswith("rounding_") for cause in named)


@pytest.mark.xfail(
    reason="x's own float32 grid (rows about 3) times an rstd of exactly 100 puts xhat on"
    " float16's grid: not told from rounding yet (a guard for it vetoed real bfloat16 rounding"
    " at C = 8)",
    strict=True,
)
@pytest.mark.parametrize("seed", [1, 3, 7, 9])  # the draws of 20 named so
def test_eps_ten_times_on_nearly_constant_rows_is_no_coarser_rounding(seed):
    named = judged_causes("nearly constant rows", 3, formula(10.0, 1.0), seed)
    assert not any(cause.startswith("rounding_") for cause in named)


def statistics_stored_in_float16(x, valid, scale, bias, eps):
    """WRONG: float32 statistics stored in float16 (a float16 kernel's own dtype) before use."""
    rows = torch.where(valid[:, None], x, 0.0).float()
    mean = rows.mean(-1, keepdim=True)
    rstd = torch.rsqrt((rows - mean).square().mean(-1, keepdim=True) + eps)
    out = (rows - mean.half().float()) * rstd.half().float() * scale.float() + bias.float()
    return torch.where(valid[:, None], out, 0.0).to(x.dtype)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("channels", [8, 64])
def test_means_of_1000_in_a_float16_result_are_no_bfloat16_rounding(channels, seed):
    """A float16 kernel's means of rows about 1e3 stored in float16 are 1000.0 (64,000 summed)
    on most rows, a bfloat16 number too, as one in eight float16 numbers there is: such a
    kernel was named "bfloat16 rounding" (16 of 54 hunt cases). The finer grid weighed against
    it is the result's own dtype's too, not only the coarser candidates'."""
    g = torch.Generator().manual_seed(seed)
    x = (1e3 + torch.randn(24, channels, generator=g, dtype=torch.float64)).half()
    scale, bias = (torch.randn(channels, generator=g).half() for _ in range(2))
    grad_out = torch.randn(24, channels, generator=g).half()
    valid = torch.rand(24, generator=g) >= 0.2
    report = kernels.verified(statistics_stored_in_float16, x, valid, scale, bias, 1e-5, grad_out)
    assert not report.passed
    named = {d["mistake"] for t in report.tensors if not t.passed for d in t.diagnosis}
    assert "rounding_bfloat16" not in named, named
