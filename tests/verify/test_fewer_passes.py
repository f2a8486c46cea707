"""verify11's shortcuts give the bits of the passes they spare: the float64 truth's grad_x made
in a buffer the caller gives, a budget zeroing the padding of its own copies, unit() without
nan_to_num where every value is finite, a block's greatest relative difference found row by
row, and whether any flag is set read as bytes."""

from __future__ import annotations

import math

import pytest
import torch

from maskln_cli.compare.comparison import Comparison
from maskln_cli.compare.judging import any_true
from maskln_cli.op import blocked
from maskln_cli.verify.budget import Precision, RowBudget, unit


def _bits(tensor: torch.Tensor) -> list[int]:
    return tensor.double().contiguous().view(torch.int64).reshape(-1).tolist()


def _rows(poisoned: bool, rows: int = 24) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(rows, 40, generator=g, dtype=torch.float64) * 1e-3 + 10
    valid = torch.rand(rows, generator=g) > 0.3
    valid[0] = True
    dy = torch.randn(rows, 40, generator=g, dtype=torch.float64)
    if poisoned and not bool(valid.all()):
        invalid = (~valid).nonzero().squeeze(1)
        x[invalid[0], 3], dy[invalid[-1], 5] = math.nan, math.inf
    return x, valid, dy


@pytest.mark.parametrize("rows", [24, 1, 0])
@pytest.mark.parametrize("poisoned", [False, True])
def test_backward_makes_dx_in_the_buffer_given(poisoned: bool, rows: int) -> None:
    x, valid, dy = _rows(poisoned, max(rows, 1))
    x, valid, dy = x[:rows], valid[:rows], dy[:rows]
    scale = torch.linspace(0.5, 2.0, 40, dtype=torch.float64)
    bias = torch.zeros(40, dtype=torch.float64)
    _, mean, rstd = blocked.forward(x, valid, scale, bias, 1e-5)
    plain = blocked.backward_in_place(dy.clone(), x, valid, scale, mean, rstd, 1e-5)
    out = torch.full_like(x, 7.0)
    given = blocked.backward_in_place(dy.clone(), x, valid, scale, mean, rstd, 1e-5, dx_out=out)
    assert given[0] is not None and plain[0] is not None
    assert given[0].data_ptr() == out.data_ptr() or not rows
    assert _bits(out) == _bits(plain[0])
    for a, b in zip(given[1:], plain[1:], strict=True):
        assert a is not None and b is not None and _bits(a) == _bits(b)


@pytest.mark.parametrize("poisoned", [False, True])
def test_budget_zeroes_its_own_copies_with_the_same_figures(poisoned: bool) -> None:
    x, valid, dy = _rows(poisoned)
    scale = torch.linspace(0.5, 2.0, 40, dtype=torch.float64)
    bias = torch.full((40,), 0.25, dtype=torch.float64)
    precision = Precision.of(torch.float32)
    copied = RowBudget(x, valid, scale, bias, 1e-5, precision, keep_deviations=True)
    x_own, dy_own = x.clone(), dy.clone()
    own = RowBudget(
        x_own, valid, scale, bias, 1e-5, precision, keep_deviations=True, own_x=True,
        own_grad_out=True,
    )  # fmt: skip
    for name in ("rstd", "xhat", "offset", "e2", "growth", "mean_abs", "deviations"):
        assert _bits(getattr(own, name)) == _bits(getattr(copied, name)), name
    assert _bits(own.grad_x(dy_own)) == _bits(copied.grad_x(dy))
    assert _bits(own.grad_x_size(dy_own)) == _bits(copied.grad_x_size(dy))
    assert _bits(own.out()) == _bits(copied.out())
    mine, theirs = own.share_of_sums(dy_own), copied.share_of_sums(dy)
    for name in ("scale_squares", "bias_squares", "moved_squares"):
        assert _bits(getattr(mine, name)) == _bits(getattr(theirs, name)), name
    assert (mine.energy, mine.second_order_sum) == (theirs.energy, theirs.second_order_sum)
    # The copies were written (their padding zeroed) only where the data was finite; valid
    # rows as they were.
    assert _bits(x_own[valid]) == _bits(x[valid])
    assert _bits(dy_own[valid]) == _bits(dy[valid])
    if not poisoned:
        assert not bool(x_own[~valid].any()) and not bool(dy_own[~valid].any())


@pytest.mark.parametrize("special", [None, math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["model", "error", "both"])
def test_unit_in_place_has_the_bits_of_nan_to_num(special: float | None, where: str) -> None:
    g = torch.Generator().manual_seed(3)
    model = torch.rand(6, 8, generator=g, dtype=torch.float64) * 1e-6
    error = torch.rand(6, 8, generator=g, dtype=torch.float64) * 1e-6
    model[0, 0] = 0.0
    if special is not None:
        if where in ("model", "both"):
            model[1, 2] = special
        if where in ("error", "both"):
            error[1, 2] = special
            error[4, 5] = special
    expected = unit(model.clone(), error.clone())
    assert _bits(unit(model.clone(), error, in_place=True)) == _bits(expected)


@pytest.mark.parametrize("case", ["ties", "zeros", "infinite"])
def test_block_greatest_relative_difference_is_the_first(case: str) -> None:
    rows, length = 6, 16
    expected = torch.linspace(1.0, 2.0, rows * length, dtype=torch.float64).reshape(rows, length)
    actual = expected.clone()
    if case == "ties":  # equal greatest ratios in two rows and twice in a row
        for r, c in ((4, 3), (2, 9), (2, 1)):
            actual[r, c] = expected[r, c] * 1.5
    elif case == "zeros":  # 0/0 (NaN, taken as 0) and x/0 (inf)
        expected[1, :] = 0.0
        actual[1, 5] = 0.0
        actual[3, 7] = expected[3, 7] * 1.25
    else:
        expected[5, 2], actual[5, 2] = 0.0, 1e-3
        expected[2, 11], actual[2, 11] = 0.0, 1e-3
    comparison = Comparison("t", [rows, length], "float64", [rows, length], "float64")
    measured = comparison.measure(actual, expected)
    assert measured is not None
    diff = (actual - expected).abs().reshape(-1)
    relative = (diff / expected.abs().reshape(-1)).nan_to_num_(nan=0.0, posinf=math.inf)
    value, index = relative.max(dim=0)
    assert measured.max_rel == (float(value), int(index))


def test_any_true_is_any() -> None:
    g = torch.Generator().manual_seed(5)
    for size in (0, 1, 7, 4096, 262144):
        for share in (0.0, 1e-5, 0.5):
            flags = torch.rand(size, generator=g) < share
            assert any_true(flags) == bool(flags.any())
    assert any_true(torch.zeros(2, 3, dtype=torch.bool)) is False


@pytest.mark.parametrize("where", ["padding", "valid row", "both"])
@pytest.mark.parametrize("own_x", [False, True])
def test_budget_of_poisoned_rows_is_that_of_their_finite_values(where: str, own_x: bool) -> None:
    """NaN and inf in the padding (zeroed by index first) or in a valid row (torch.where over
    every element): the statistics of x with every one of them, and the padding, set to 0."""
    x, valid, _ = _rows(False)
    invalid = (~valid).nonzero().squeeze(1)
    if where != "valid row":
        x[invalid[0], 3], x[invalid[-1], 0] = math.nan, -math.inf
    if where != "padding":
        x[0, 7] = math.inf
    scale = torch.linspace(0.5, 2.0, 40, dtype=torch.float64)
    bias = torch.full((40,), 0.25, dtype=torch.float64)
    precision = Precision.of(torch.float32)
    finite = torch.where(valid.unsqueeze(1) & x.isfinite(), x, 0.0)
    expected = RowBudget(finite, valid, scale, bias, 1e-5, precision, keep_deviations=True)
    given = x.clone()
    found = RowBudget(given, valid, scale, bias, 1e-5, precision, keep_deviations=True, own_x=own_x)
    for name in ("rstd", "xhat", "offset", "e2", "growth", "mean_abs", "deviations"):
        assert _bits(getattr(found, name)) == _bits(getattr(expected, name)), name
    assert _bits(found.out()) == _bits(expected.out())
    assert _bits(given[valid]) == _bits(x[valid])  # valid rows untouched, NaN and inf included
