"""A half kernel that rounds float32 scale and bias to its dtype (nn.LayerNorm after .half())
scales every row's output by the same per-channel rounding: at C = 2 each row normalizes to
about +-1, so all rows agree on it, and it was said "all 32 valid rows scaled by 1 + 0.00017
± 7e-06: systematic, not rounding" (found by a hunt for false FAILs: its error is the float64
truth rounded to float16's). The parameters' rounding is what a correct kernel may be
systematically off by; an output scaled by 1 + 1e-2 still fails."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from maskln_cli.testing import check_kernel


def layer_norm_params_cast(x, valid, scale, bias, eps, factor=1.0):
    x0 = x.masked_fill(~valid[..., None], 0)
    y = F.layer_norm(x0, x.shape[-1:], scale.to(x.dtype), bias.to(x.dtype), eps) * factor
    return y.masked_fill(~valid[..., None], 0)


def two_channels(seed, rows=32):
    g = torch.Generator().manual_seed(seed)
    x = (100 * torch.randn(rows, 2, generator=g, dtype=torch.float64)).half()
    scale, bias = 1 + 0.3 * torch.randn(2, generator=g), 0.3 * torch.randn(2, generator=g)
    grad_out = torch.randn(rows, 2, generator=g, dtype=torch.float64).half()
    return x, torch.ones(rows, dtype=torch.bool), scale, bias, 1e-5, grad_out


@pytest.mark.parametrize("seed", [14, 0, 1])
def test_rounding_float32_parameters_to_float16_passes(seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_kernel(layer_norm_params_cast, *two_channels(seed))


def test_an_output_scaled_by_one_percent_still_fails():
    def wrong(x, valid, scale, bias, eps):
        return layer_norm_params_cast(x, valid, scale, bias, eps, factor=1.01)

    with warnings.catch_warnings(), pytest.raises(AssertionError, match="out"):
        warnings.simplefilter("ignore")
        check_kernel(wrong, *two_channels(14))
