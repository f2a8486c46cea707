"""Upstream gradients below the compute dtype's smallest normal (float32 grad_out of 1e-40,
float64 of 1e-320): every operation of a correct backward on such values rounds at half the
spacing of that dtype's subnormals, absolutely, which is far more than its relative rounding.
Correct kernels (PyTorch's F.layer_norm, a two-pass kernel, hand-written backwards) were
failed on grad_x, "beyond the budget" and "mean error on each row beyond that row's rounding"
(issue 37: found by a hunt for false FAILs; F.layer_norm failed 20 of 20 draws at 1e-40). The
same mistakes as on normal gradients still fail there."""

from __future__ import annotations

import pytest
import torch

from maskln_cli.testing import verify
from tests import kernels

CORRECT = ("F.layer_norm", "two-pass", "written", "written, torch's form", "maskln", "Welford")
SIZES = {"float32": (1e-39, 1e-40, 1e-42, 1e-44), "float64": (1e-310, 1e-315, 1e-320)}


def inputs(seed: int, dtype: str, size: float, channels: int) -> kernels.Tensors:
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    rows = 24
    cast = getattr(torch, dtype)
    return {
        "x": draw(rows, channels).to(cast),
        "valid": torch.rand(rows, generator=g) < 0.8,
        "scale": draw(channels).to(cast),
        "bias": draw(channels).to(cast),
        "grad_out": (size * draw(rows, channels)).to(cast),
    }


def judged(kernel: kernels.Kernel, tensors: kernels.Tensors):
    result = kernels.zero_padding(kernels.run(kernel, tensors), tensors["valid"])
    return verify(
        result["out"], tensors["x"], tensors["valid"], tensors["scale"], tensors["bias"],
        kernels.EPS, grad_out=tensors["grad_out"], grad_x=result["grad_x"],
        grad_scale=result["grad_scale"], grad_bias=result["grad_bias"],
    )  # fmt: skip


@pytest.mark.parametrize("name", CORRECT)
@pytest.mark.parametrize(("dtype", "size"), [(d, s) for d, sizes in SIZES.items() for s in sizes])
@pytest.mark.parametrize("channels", [16, 64])
def test_correct_kernels_pass_with_subnormal_upstream_gradients(name, dtype, size, channels):
    kernel = kernels.CORRECT_EVERYWHERE[name][0]
    for seed in range(3):
        report = judged(kernel, inputs(seed, dtype, size, channels))
        assert report.passed, [t.problems for t in report.tensors if not t.passed]


@pytest.mark.parametrize("mistake", ["no_xhat_term", "no_mean_term", "c1_over_c_minus_1"])
@pytest.mark.parametrize(("dtype", "size"), [("float32", 1e-40), ("float64", 1e-315)])
def test_backward_mistakes_still_fail_with_subnormal_upstream_gradients(mistake, dtype, size):
    failed = 0
    for seed in range(3):
        report = judged(kernels.written(mistake), inputs(seed, dtype, size, 64))
        failed += not {t.name for t in report.tensors if not t.passed}.isdisjoint({"grad_x"})
    assert failed == 3
