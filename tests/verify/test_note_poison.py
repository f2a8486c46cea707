"""verify remembers a few invalid rows holding NaN or inf (for a NaN gradient's diagnosis),
summing only the invalid rows to find them: the same rows as looking at every value."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from maskln_cli.verify.measure import StreamingPass

ROWS, LENGTH = 40, 16


def _chunk(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, valid and grad_out with NaN and inf in some invalid rows (of x, of grad_out, both),
    in valid rows too (not remembered), and finite values whose float16 sum overflows."""
    g = torch.Generator().manual_seed(29)
    x = torch.randn(ROWS, LENGTH, generator=g).to(dtype)
    dy = torch.randn(ROWS, LENGTH, generator=g).to(dtype)
    valid = torch.rand(ROWS, generator=g) > 0.4
    invalid = (~valid).nonzero().squeeze(1).tolist()
    x[invalid[0], 3] = math.nan
    dy[invalid[1], 0] = math.inf
    x[invalid[2], 5], dy[invalid[2], 7] = -math.inf, math.nan
    x[invalid[3], :] = 6e4 if dtype == torch.float16 else 3e38  # finite, its sum is not
    valid_row = valid.nonzero()[0, 0]
    x[valid_row, 1] = math.nan
    return x, valid, dy


def _expected(x: torch.Tensor, valid: torch.Tensor, dy: torch.Tensor | None) -> list[int]:
    bad = ~x.isfinite().all(dim=1)
    if dy is not None:
        bad |= ~dy.isfinite().all(dim=1)
    return (bad & ~valid).nonzero().squeeze(1).tolist()


class _RowSums(TorchFunctionMode):
    """The row counts of the tensors summed."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "sum" and args and isinstance(args[0], torch.Tensor):
            self.rows.append(len(args[0]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("with_grad_out", [True, False])
def test_poisoned_rows_are_found_from_the_invalid_rows_alone(
    dtype: torch.dtype, with_grad_out: bool
) -> None:
    x, valid, dy = _chunk(dtype)
    upstream = dy if with_grad_out else None
    holder = SimpleNamespace(poisoned=[])
    with _RowSums() as sums:
        StreamingPass._note_poison(holder, 100, x, valid, upstream)  # type: ignore[arg-type]
    assert holder.poisoned == [100 + r for r in _expected(x, valid, upstream)]
    assert sums.rows and max(sums.rows) == int((~valid).sum())  # the invalid rows' only
