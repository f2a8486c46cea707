"""The float64 truth's backward takes the forward's xhat (blocked.forward_keeping_xhat):
every output the same bits as the backward making it again, whatever the rows hold."""

from __future__ import annotations

import math

import pytest
import torch

from maskln_cli.op import blocked


def _bits(tensor: torch.Tensor) -> list[int]:
    return tensor.double().contiguous().view(torch.int64).reshape(-1).tolist()


def _rows(kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, 40, generator=g, dtype=torch.float64)
    valid = torch.rand(24, generator=g) > 0.3
    valid[0] = True
    dy = torch.randn(24, 40, generator=g, dtype=torch.float64)
    if kind == "offset":  # the mean's rounding (shift) matters
        x = x * 1e-3 + 1e4
    elif kind == "poisoned":  # NaN and inf in the padding, of x and dy
        invalid = (~valid).nonzero().squeeze(1)
        x[invalid[0], 3], x[invalid[-1], 5] = math.nan, math.inf
        dy[invalid[0], 1] = math.nan
    elif kind == "rescued":  # a valid row overflowing float64's squares, one underflowing
        x[0] = x[0] * 1e200
        x[1] = x[1] * 1e-160
        valid[:2] = True
    elif kind == "constant":  # a valid row of one value: xhat 0, rstd 1 / sqrt(eps)
        x[2] = 3.0
        valid[2] = True
    elif kind == "one_row":
        x, valid, dy = x[:1], valid[:1], dy[:1]
    return x, valid, dy


@pytest.mark.parametrize("kind", ["plain", "offset", "poisoned", "rescued", "constant", "one_row"])
def test_backward_from_the_forwards_xhat_is_the_same_bits(kind: str) -> None:
    x, valid, dy = _rows(kind)
    g = torch.Generator().manual_seed(8)
    scale = torch.randn(x.shape[-1], generator=g, dtype=torch.float64)
    bias = torch.randn(x.shape[-1], generator=g, dtype=torch.float64)
    y, mean, rstd = blocked.forward(x, valid, scale, bias, 1e-5)
    xhat = torch.empty_like(x)
    y2, mean2, rstd2, kept = blocked.forward_keeping_xhat(x, valid, scale, bias, 1e-5, xhat)
    for a, b in ((y, y2), (mean, mean2), (rstd, rstd2)):
        assert _bits(a) == _bits(b)
    assert kept == (kind in ("plain", "offset", "poisoned", "constant"))
    expected = blocked.backward_in_place(dy, x, valid, scale, mean, rstd, 1e-5)
    got = blocked.backward_in_place(
        dy, x, valid, scale, mean, rstd, 1e-5, xhat=xhat if kept else None
    )
    for a, b in zip(expected, got, strict=True):
        assert a is not None and b is not None
        assert _bits(a) == _bits(b)
    if kept:  # the forward's xhat is the backward's, its padding set to 0
        normalized = torch.where(valid.unsqueeze(1), (y - bias) / scale, 0.0)
        assert torch.allclose(xhat, normalized, rtol=1e-9, atol=1e-9)
