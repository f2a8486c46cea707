"""Passes over a block that ``maskln verify`` makes fewer of (a product kept, a bound's rows
told apart by their least value, a constant added once, a buffer written in place): each
figure the same bits as the passes it replaces."""

from __future__ import annotations

import math

import pytest
import torch

from maskln_cli.compare.judging import BlockJudge
from maskln_cli.verify import budget as budgets
from maskln_cli.verify.budget import Precision, RowBudget, SumBudget

ROWS, LENGTH = 12, 16


def _bits(tensor: torch.Tensor) -> list[int]:
    """A float64 tensor's bits (NaN payloads and -0.0 told apart)."""
    return tensor.double().contiguous().view(torch.int64).reshape(-1).tolist()


def _same_judged(a: tuple | None, b: tuple | None) -> bool:
    if a is None or b is None:
        return a is b
    for x, y in zip(a, b, strict=True):
        if isinstance(x, tuple) or isinstance(y, tuple):
            if not _same_judged(x, y):
                return False
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if x is None or y is None or x.dtype != y.dtype or _bits(x) != _bits(y):
                return False
        elif not (x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))):
            return False
    return True


def _block(seed: int) -> dict[str, torch.Tensor]:
    """A block's differences, bounds and pieces, with rows of every kind a bound of 0 or less
    comes in: padding that is 0 (bound 0), padding that is not, a valid row with some bounds
    of 0, one with a NaN bound, and an element beyond its bound."""
    g = torch.Generator().manual_seed(seed)
    diff = torch.rand(ROWS, LENGTH, generator=g, dtype=torch.float64) * 1e-6
    bound = torch.rand(ROWS, LENGTH, generator=g, dtype=torch.float64) * 1e-5 + 1e-6
    always = bound / 4
    unit = bound / 3
    bound[2] = 0.0  # padding, all 0
    diff[2] = 0.0
    always[2] = math.inf
    bound[5] = 0.0  # padding that is not 0
    diff[5, 3] = 1e-7
    always[5] = math.inf
    bound[7, ::3] = 0.0  # a valid row with some bounds of 0 (and a difference there)
    bound[9, 4] = math.nan
    actual = torch.randn(ROWS, LENGTH, generator=g).reshape(-1)
    e64 = torch.randn(ROWS, LENGTH, generator=g, dtype=torch.float64).reshape(-1)
    return {
        "diff": diff.reshape(-1), "bound": bound.reshape(-1), "always": always.reshape(-1),
        "unit": unit.reshape(-1), "actual": actual, "e64": e64,
    }  # fmt: skip


def _judge(block: dict[str, torch.Tensor], positive: bool | None, rank_by_ratio: bool, **kw):
    judge = BlockJudge(LENGTH, rank_by_ratio)
    return judge.judge(
        block["diff"].clone(), block["bound"], positive, block["actual"], block["e64"], ROWS,
        block["unit"], block["always"], **kw,
    )  # fmt: skip


@pytest.mark.parametrize("rank_by_ratio", [True, False])
@pytest.mark.parametrize("case", ["mixed", "zero_padding", "beyond", "all_positive", "nan_row"])
def test_ratio_by_rows_is_the_whole_blocks(case: str, rank_by_ratio: bool) -> None:
    """``positive=None`` (the rows allowed more than 0 found by each row's least bound, their
    greatest ratios taken row by row) gives every figure of the whole block's masked pass:
    counts, greatest ratio, factor and worst elements, with or without each row's greatest
    difference given."""
    block = _block(3)
    rows = block["diff"].view(ROWS, LENGTH)
    if case == "zero_padding":  # only padding that is 0: nothing beyond, no ratio of 1
        block["bound"].view(ROWS, LENGTH)[5] = 1e-6
        block["bound"].view(ROWS, LENGTH)[7] = 1e-6
        block["bound"].view(ROWS, LENGTH)[9] = 1e-6
    elif case == "beyond":  # a valid element beyond its bound
        rows[4, 6] = 1.0
    elif case == "all_positive":
        block["bound"].view(ROWS, LENGTH)[[2, 5, 7, 9]] = 1e-6
    elif case == "nan_row":
        block["bound"].view(ROWS, LENGTH)[[2, 5, 7]] = 1e-6
    whole = block["bound"].amin() > 0
    expected = _judge(block, bool(whole), rank_by_ratio)
    assert _same_judged(_judge(block, None, rank_by_ratio), expected)
    row_max = rows.amax(dim=1)
    assert _same_judged(_judge(block, None, rank_by_ratio, row_max=row_max), expected)
    if case == "beyond":
        assert expected is not None and expected[0] is not None and expected[1] >= 1


@pytest.mark.parametrize("atol", [0.0, 1e-5, 3e-29, 1e-300, "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_floor_of_a_tensor_atol_is_the_two_additions_bits(
    atol: float | str, dtype: torch.dtype
) -> None:
    """A per-row atol and the subnormal added in one pass where that rounds alike (atols of 0
    or far above the subnormal), in two elsewhere: the bits of adding them one after the
    other, truths of 0 and subnormal included."""
    g = torch.Generator().manual_seed(1)
    truth = torch.randn(6, 8, generator=g, dtype=torch.float64)
    truth[0] = 0.0
    truth[1, :3] = torch.tensor([1e-320, -5e-310, 2.0**-1074], dtype=torch.float64)
    if atol == "mixed":
        size = torch.tensor([[0.0], [1e-5], [1e-40], [1.0], [3e-12], [0.0]], dtype=torch.float64)
    else:
        size = torch.full((6, 1), float(atol), dtype=torch.float64)
    info = torch.finfo(dtype)
    relative = max(1.3e-6, budgets.ULPS * info.eps)
    subnormal = budgets.ULPS * info.tiny * info.eps
    expected = truth.abs().nan_to_num_(nan=0.0, posinf=0.0).mul_(relative)
    expected = expected.add_(size).add_(subnormal)
    assert _bits(budgets.floor(truth, dtype, 1.3e-6, size)) == _bits(expected)
    assert _bits(budgets.floor(truth, dtype, 1.3e-6, size, truth.abs())) == _bits(expected)


def test_unit_in_place_is_the_same_bits() -> None:
    """``unit(in_place=True)`` writes the budget into the model: the bits of a new one."""
    g = torch.Generator().manual_seed(2)
    model = torch.rand(4, 8, generator=g, dtype=torch.float64)
    model[0, 0], model[1, 1] = math.nan, math.inf
    error = torch.rand(4, 8, generator=g, dtype=torch.float64)
    error[2, 2], error[3, 3] = math.inf, math.nan
    expected = budgets.unit(model, error)
    written = model.clone()
    got = budgets.unit(written, error, in_place=True)
    assert got.data_ptr() == written.data_ptr()
    assert _bits(got) == _bits(expected)


def _rows_budget(precision: Precision, seed: int = 4) -> tuple[RowBudget, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(10, 64, generator=g, dtype=torch.float64) * 0.5 + 3.0
    valid = torch.ones(10, dtype=torch.bool)
    valid[[1, 6]] = False
    x[1, 0] = math.nan  # padding may hold anything
    dy = torch.randn(10, 64, generator=g, dtype=torch.float64)
    scale = torch.rand(64, generator=g, dtype=torch.float64) - 0.3
    bias = torch.randn(64, generator=g, dtype=torch.float64)
    rows = RowBudget(x, valid, scale, bias, 1e-5, precision, keep_deviations=True)
    return rows, dy


def test_grad_x_model_and_sums_from_kept_products_are_those_made_afresh() -> None:
    """grad_x's model takes ``scale * upstream`` from wdy_rms (made for its size first, as
    a block does) and |xhat| kept for the sums: the bits of a budget that made them afresh,
    in its own dtype and in another one sharing its statistics (which must find them
    unwritten)."""
    f32, bf16 = Precision.of(torch.float32), Precision.of(torch.bfloat16, x_dtype=torch.float32)
    fresh32, dy = _rows_budget(f32)
    fresh16 = _rows_budget(bf16)[0]
    expected = {
        "f32": fresh32.grad_x(dy), "bf16": fresh16.grad_x(dy),
        "size": fresh32.grad_x_size(dy), "sums": _sums(fresh32, dy),
    }  # fmt: skip
    rows, _ = _rows_budget(f32)
    size = rows.grad_x_size(dy)  # makes wdy, kept
    other = rows.judged_in(bf16)
    got = {"f32": rows.grad_x(dy), "bf16": other.grad_x(dy), "size": size, "sums": _sums(rows, dy)}
    for name in ("f32", "bf16", "size"):
        assert _bits(got[name]) == _bits(expected[name]), name
    assert got["sums"] == expected["sums"]
    assert _bits(rows.grad_x(dy)) == _bits(expected["f32"])  # again: nothing written


def _sums(rows: RowBudget, dy: torch.Tensor) -> list:
    share: SumBudget = rows.share_of_sums(dy)
    tensors = (share.scale_squares, share.bias_squares, share.moved_squares)
    return [_bits(t) for t in tensors] + [share.second_order_sum, share.energy, share.rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_padding_in_its_own_dtype_is_that_of_float64(dtype: torch.dtype) -> None:
    """Padding read in its own dtype (no float64 copy of the rows): the same zeros and count
    of -0.0 as converted to float64, NaN of either sign and infinities included."""
    from maskln_cli.compare.figures import padding_of

    values = [0.0, -0.0, -0.0, 1e-3, -2.0, math.nan, -math.nan, math.inf, -math.inf]
    g = torch.Generator().manual_seed(5)
    for size in (2, 5, 9):
        rows = torch.tensor(values, dtype=torch.float64)[torch.randperm(9, generator=g)[:size]]
        padded = rows.to(dtype).reshape(1, -1)
        assert padding_of(padded) == padding_of(padded.double())
    zeros = torch.tensor([[0.0, -0.0, -0.0]], dtype=dtype)
    assert padding_of(zeros) == padding_of(zeros.double()) == (True, 2)
