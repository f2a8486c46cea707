"""float64 upstream gradients of 1e80 to 1e300: the systematic test's regression weights (a row's
energy, squared: grad_x**4) overflow float64, and verify stopped with "OverflowError: Numerical
result out of range" (a traceback through maskln_cli.testing, and through `maskln verify`) from
1e150 up. Sums that overflow now leave that test undone, and the budget judges alone."""

from __future__ import annotations

import pytest
import torch

from tests import kernels


def _inputs(seed: int, magnitude: float):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 64, generator=g, dtype=torch.float64)
    scale = torch.randn(64, generator=g, dtype=torch.float64)
    bias = torch.randn(64, generator=g, dtype=torch.float64)
    grad_out = torch.randn(16, 64, generator=g, dtype=torch.float64) * magnitude
    valid = torch.rand(16, generator=g) > 0.2
    return x, valid, scale, bias, grad_out


@pytest.mark.parametrize("magnitude", [1e80, 1e150, 1e200, 1e300])
@pytest.mark.parametrize("seed", range(2))
def test_pytorch_passes_with_huge_upstream_gradients(magnitude, seed):
    report = kernels.verified(
        lambda *a: kernels.torch_layer_norm(*a[:4]), *_inputs(seed, magnitude)[:4], kernels.EPS,
        _inputs(seed, magnitude)[4],
    )  # fmt: skip
    assert report.passed, [t.problems for t in report.tensors if not t.passed]


@pytest.mark.parametrize("magnitude", [1e80, 1e200])
def test_a_backward_without_its_mean_term_fails_with_huge_upstream_gradients(magnitude):
    x, valid, scale, bias, grad_out = _inputs(0, magnitude)
    kernel = kernels.written("no_mean_term")
    report = kernels.verified(lambda *a: kernel(*a[:4]), x, valid, scale, bias, 1e-5, grad_out)
    failing = {t.name for t in report.tensors if not t.passed}
    assert "grad_x" in failing, failing
