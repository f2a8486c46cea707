"""A block's greatest relative difference row by row, NaN (0/0) taken as 0 without a pass over
the block to replace it: the figures of ``nan_to_num`` over every element."""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from maskln_cli.compare.blocks import relative_row_max
from maskln_cli.compare.comparison import Comparison

ROWS, LENGTH = 8, 16


def _bits(tensor: torch.Tensor) -> list[int]:
    return tensor.double().contiguous().view(torch.int64).reshape(-1).tolist()


def _block(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """actual and expected (float64): padding rows of 0 (0/0 everywhere), padding that is not
    0 (x/0: inf), a valid row with an exact 0 matched (one 0/0) and one missed."""
    g = torch.Generator().manual_seed(23)
    expected = torch.randn(ROWS, LENGTH, generator=g, dtype=torch.float64)
    actual = expected * (1 + 1e-7 * torch.randn(ROWS, LENGTH, generator=g, dtype=torch.float64))
    expected[1], actual[1] = 0.0, 0.0  # padding left 0
    if case in ("padding written", "all"):
        expected[3], actual[3] = 0.0, 0.0
        actual[3, 5] = 1e-9  # padding written: 0/0 and x/0 in one row
    if case in ("exact zeros", "all"):
        expected[4, 2], actual[4, 2] = 0.0, 0.0  # a valid row's 0, matched
        expected[6, 9], actual[6, 9] = 0.0, 0.0
        actual[6, 3] = expected[6, 3] * 1.5  # beside a large relative difference
    return actual, expected


@pytest.mark.parametrize("case", ["padding left 0", "padding written", "exact zeros", "all"])
def test_relative_row_max_is_that_of_nan_to_num(case: str) -> None:
    actual, expected = _block(case)
    diff = (actual - expected).abs()
    relative = diff / expected.abs()
    wanted = relative.nan_to_num(nan=0.0, posinf=math.inf).amax(dim=1)
    assert _bits(relative_row_max(relative.clone(), diff.amax(dim=1))) == _bits(wanted)
    comparison = Comparison("t", [ROWS, LENGTH], "float64", [ROWS, LENGTH], "float64")
    measured = comparison.measure(actual, expected)
    assert measured is not None
    value, index = relative.nan_to_num(nan=0.0, posinf=math.inf).reshape(-1).max(dim=0)
    assert measured.max_rel == (float(value), int(index))


class _NanToNum(TorchFunctionMode):
    """The elements nan_to_num is called on."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "").startswith("nan_to_num") and args:
            self.elements += args[0].numel()
        return func(*args, **(kwargs or {}))


def test_a_block_with_padding_left_0_replaces_no_nan_in_bulk() -> None:
    """Padding left 0 by the kernel (0/0 on every element): read no more than a row's worth
    by nan_to_num (the old code replaced NaN over the whole block)."""
    actual, expected = _block("padding left 0")
    comparison = Comparison("t", [ROWS, LENGTH], "float64", [ROWS, LENGTH], "float64")
    with _NanToNum() as calls:
        measured = comparison.measure(actual, expected)
    assert measured is not None
    assert calls.elements <= LENGTH
