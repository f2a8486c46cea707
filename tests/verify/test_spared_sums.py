"""A block's budget tests x and grad_out for NaN and inf by figures it makes anyway (x's row
means, each row's rms of ``scale * grad_out``) instead of a sum over the whole block of each:
the same bits as the finite data's, whatever NaN or inf the block holds, and where."""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from maskln_cli.verify.budget import Precision, RowBudget

ROWS, LENGTH = 24, 40


def _bits(tensor: torch.Tensor) -> list[int]:
    return tensor.double().contiguous().view(torch.int64).reshape(-1).tolist()


def _block(where: str, value: float) -> tuple[torch.Tensor, ...]:
    """x, valid and grad_out (float64), with ``value`` in grad_out's padding, in a valid row
    at a channel whose scale is 0, or both; and scale with that 0."""
    g = torch.Generator().manual_seed(17)
    x = torch.randn(ROWS, LENGTH, generator=g, dtype=torch.float64) * 1e-3 + 10
    valid = torch.rand(ROWS, generator=g) > 0.3
    valid[0] = True
    valid[1] = False
    dy = torch.randn(ROWS, LENGTH, generator=g, dtype=torch.float64)
    scale = torch.linspace(0.5, 2.0, LENGTH, dtype=torch.float64)
    scale[6] = 0.0
    if where in ("padding", "both"):
        dy[1, 2] = value
    if where in ("valid row", "both"):
        dy[0, 6] = value  # times a scale of 0: NaN, whatever value is
    return x, valid, dy, scale


class _WholeSums(TorchFunctionMode):
    """Counts sums to a single value of tensors of ``[ROWS, LENGTH]``."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "sum" and args and isinstance(args[0], torch.Tensor):
            whole = len(args) < 2 and kwargs.get("dim") is None
            if whole and args[0].shape == (ROWS, LENGTH):
                self.count += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["padding", "valid row", "both"])
@pytest.mark.parametrize("own", [False, True])
def test_upstream_tested_by_its_rms_has_the_finite_upstreams_bits(
    where: str, value: float, own: bool
) -> None:
    x, valid, dy, scale = _block(where, value)
    bias = torch.full((LENGTH,), 0.25, dtype=torch.float64)
    precision = Precision.of(torch.float32)
    finite = torch.where(valid.unsqueeze(1) & dy.isfinite(), dy, 0.0)
    expected = RowBudget(x, valid, scale, bias, 1e-5, precision)
    wanted = {
        "size": expected.grad_x_size(finite), "model": expected.grad_x(finite),
        "upstream": expected.upstream(finite),
    }  # fmt: skip
    for first in ("size", "model"):  # wdy_rms first (a block's order), or upstream()
        given = dy.clone()
        budget = RowBudget(x, valid, scale, bias, 1e-5, precision, own_grad_out=own)
        found = {}
        if first == "size":
            found["size"] = budget.grad_x_size(given)
        found["model"] = budget.grad_x(given)
        found["size"] = budget.grad_x_size(given)
        found["upstream"] = budget.upstream(given)
        for name, tensor in wanted.items():
            assert _bits(found[name]) == _bits(tensor), (first, name)
        if own:  # valid rows as they were, NaN and inf included
            assert _bits(given[valid]) == _bits(dy[valid])


def test_a_blocks_budget_sums_neither_x_nor_grad_out_whole() -> None:
    """RowBudget's statistics and grad_x's size (in a block's order) on finite data: no sum
    of all of x or of grad_out (the old code made one each, to test for NaN and inf)."""
    x, valid, dy, scale = _block("none", 0.0)
    bias = torch.zeros(LENGTH, dtype=torch.float64)
    with _WholeSums() as sums:
        budget = RowBudget(
            x.clone(), valid, scale, bias, 1e-5, Precision.of(torch.float32),
            keep_deviations=True, own_x=True, own_grad_out=True,
        )  # fmt: skip
        budget.grad_x_size(dy.clone())
    assert sums.count == 0
