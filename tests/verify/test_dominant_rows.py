"""Rows one of which dominates the pooled factor's weights: a row whose variance is at or below
a tiny eps (rstd 1e6 where the others' is 100) has a grad_x 1e4 times theirs, and so all but the
whole weight. The spread of the other rows then says nothing of the pooled factor's error, which
is that one row's rounding: the systematic test must judge it as one row, not as many that agree
(a correct float64 kernel failed with "all 8 valid rows scaled by 1 + 6.6e-15 ± 2e-20", drawn by
the pytest guide's Hypothesis example; these cases failed 100 to 188 times in 200 draws)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from maskln_cli import masked_layer_normalization
from maskln_cli.testing import check_kernel

EPS = 1e-12


def torch_layer_norm(x, valid, scale, bias, eps):
    out = F.layer_norm(x, x.shape[-1:], scale, bias, eps)
    return out.masked_fill(~valid[..., None], 0.0)


def two_pass(x, valid, scale, bias, eps, unbiased=False, eps_inside=None):
    padding = ~valid[..., None]
    x = x.masked_fill(padding, 0.0)
    centered = x - x.mean(dim=-1, keepdim=True)
    variance = centered.square().sum(dim=-1, keepdim=True) / (x.shape[-1] - unbiased)
    out = centered / torch.sqrt(variance + (eps if eps_inside is None else eps_inside))
    return (out * scale + bias).masked_fill(padding, 0.0)


CORRECT = {
    "F.layer_norm": torch_layer_norm,
    "two-pass": two_pass,
    "maskln": masked_layer_normalization,
}
WRONG = {
    "unbiased variance": lambda *a: two_pass(*a, unbiased=True),
    "eps 1.1e-12 for 1e-12": lambda *a: two_pass(*a, eps_inside=1.1e-12),
}
FAMILIES = [(5, 8, 0.01, 1e-6), (5, 8, 0.01, 1e-5), (16, 8, 0.01, 1e-6), (64, 16, 1.0, 1e-7)]


def rows_with_one_tiny_variance(channels, rows, spread, tiny, seed):
    """float64 rows about N(0, 1) of a spread ``spread``, the last of a spread ``tiny`` (its
    variance near or below eps), with scale, bias and grad_out drawn."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    x = draw(rows, 1) + draw(rows, channels) * spread
    x[-1] = draw(1) + draw(channels) * tiny
    valid = torch.ones(rows, dtype=torch.bool)
    return x, valid, draw(channels), draw(channels), draw(rows, channels)


@pytest.mark.parametrize("kernel", list(CORRECT))
@pytest.mark.parametrize(("channels", "rows", "spread", "tiny"), FAMILIES)
@pytest.mark.parametrize("seed", range(3))
def test_correct_float64_kernels_pass_where_one_row_dominates(
    kernel, channels, rows, spread, tiny, seed
):
    inputs = rows_with_one_tiny_variance(channels, rows, spread, tiny, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rows of 5 channels: "not checked", said
        check_kernel(CORRECT[kernel], *inputs[:4], EPS, inputs[4])


@pytest.mark.parametrize("kernel", list(WRONG))
@pytest.mark.parametrize(("channels", "rows", "spread", "tiny"), FAMILIES)
def test_wrong_kernels_still_fail_where_one_row_dominates(kernel, channels, rows, spread, tiny):
    inputs = rows_with_one_tiny_variance(channels, rows, spread, tiny, 0)
    with warnings.catch_warnings(), pytest.raises(AssertionError, match="FAIL"):
        warnings.simplefilter("ignore")
        check_kernel(WRONG[kernel], *inputs[:4], EPS, inputs[4])
