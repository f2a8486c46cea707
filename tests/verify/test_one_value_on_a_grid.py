"""A coarser dtype's rounding is named only where what the kernel computed lies on that dtype's
grid at many distinct points: a formula mistake that gives every row the same statistic (eps
ten times too large on nearly constant rows: each row's variance recovered as about 9 eps; out
multiplied by 1.01 at eps 1, each recovered as about -0.0198) lands all its rows on one number,
and that number on a float16 or bfloat16 grid point by chance. Such float32 kernels, computing
in float32 throughout, were named "float16 rounding" in 1 to 4 of 20 draws, and "bfloat16
rounding" in 2 of 20 (found by a hunt for wrong causes)."""

from __future__ import annotations

import warnings

import pytest
import torch

from maskln_cli.testing import verify


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


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize(
    ("family", "channels", "kernel"),
    [
        ("nearly constant rows", 3, formula(10.0, 1.0)),
        ("small rows at eps 1", 5, formula(1.0, 1.01)),
    ],
    ids=["eps x 10", "out x 1.01"],
)
def test_a_float32_formula_mistake_is_no_coarser_rounding(family, channels, kernel, seed):
    (x, scale, bias, grad_out), valid, eps = draw(family, seed, channels)
    leaves = [t.clone().requires_grad_() for t in (x, scale, bias)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = kernel(leaves[0], valid, leaves[1], leaves[2], eps)
        grads = torch.autograd.grad(out, leaves, grad_out)
        report = verify(
            out.detach(), x, valid, scale, bias, eps, grad_out=grad_out, grad_x=grads[0],
            grad_scale=grads[1], grad_bias=grads[2],
        )  # fmt: skip
    assert not report.passed
    named = {d["mistake"] for t in report.tensors if not t.passed for d in t.diagnosis}
    assert not any(cause.startswith("rounding_") for cause in named)
