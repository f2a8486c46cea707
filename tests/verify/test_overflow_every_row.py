"""An overflow of a row's statistics leaves every row it reaches wrong: a kernel without eps on
bfloat16 rows at an offset of 1e3 (most rows one value there: 0/0, NaN) was named "the row
statistics overflow float16" (20 of 20 draws at C = 5), since float16 statistics would overflow
on every row and NaN stood on most of them, though the rows that are not one value were right
(found by a hunt for wrong causes). Rows whose mean square is beyond the dtype overflow whatever
a kernel keeps, a sum or a mean of squares: every one of them must be wrong for the overflow to
be named; and rows of one value in x as given are no evidence either way (float16 rows of 1e4
+ N(0, 0.5), NaN on each: a 0/0 as much as an overflow). A kernel whose statistics do overflow is
still named so."""

from __future__ import annotations

import pytest
import torch

from maskln_cli.testing import verify
from tests import kernels


def eps_missing(x, valid, scale, bias, eps):
    rows = torch.where(valid[:, None], x, torch.zeros((), dtype=x.dtype)).float()
    mean = rows.mean(-1, keepdim=True)
    var = (rows - mean).square().mean(-1, keepdim=True)
    out = (rows - mean) / torch.sqrt(var) * scale.float() + bias.float()
    return torch.where(valid[:, None], out, 0.0).to(x.dtype)


def named(kernel, seed, channels=5, offset=1e3, dtype=torch.bfloat16, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (spread * torch.randn(24, channels, generator=g, dtype=torch.float64) + offset).to(dtype)
    scale = torch.randn(channels, generator=g, dtype=torch.float64).to(dtype)
    bias = torch.randn(channels, generator=g, dtype=torch.float64).to(dtype)
    grad_out = torch.randn(24, channels, generator=g, dtype=torch.float64).to(dtype)
    valid = torch.arange(24) < 20
    report = kernels.verified(kernel, x, valid, scale, bias, 1e-5, grad_out)
    assert not report.passed
    return {d["mistake"] for t in report.tensors if not t.passed for d in t.diagnosis}


@pytest.mark.parametrize("seed", range(4))
def test_nan_on_the_rows_of_one_value_is_not_named_an_overflow(seed):
    assert "statistics_overflow" not in named(eps_missing, seed)


@pytest.mark.parametrize("seed", range(3))
def test_rows_all_of_one_value_are_no_evidence_of_an_overflow(seed):
    """float16 rows of 1e4 + N(0, 0.5) are 1e4 on every channel: NaN on every valid row is a
    0/0 as much as an overflow (named so in 10 of 10 draws); eps missing is named."""
    causes = named(eps_missing, seed, 16, offset=1e4, dtype=torch.float16, spread=0.5)
    assert "statistics_overflow" not in causes


@pytest.mark.parametrize("family", ["1e4 + N(0, 0.1)", "C = 768, 1e4 + N(0, 0.1)"])
def test_statistics_that_overflow_float16_are_still_named(family):
    """The catalogue's kernel summing its rows in float16 (each row's sum of 1e4s is inf)."""
    inputs = kernels.DATA_FAMILIES[family](0, dtype="float32")
    result = kernels.run(kernels.CATALOGUE["row sums in float16"].kernel, inputs)
    report = verify(
        result["out"], inputs["x"], inputs["valid"], inputs["scale"], inputs["bias"], 1e-5,
        grad_out=inputs["grad_out"], grad_x=result["grad_x"], grad_scale=result["grad_scale"],
        grad_bias=result["grad_bias"],
    )  # fmt: skip
    causes = {d["mistake"] for t in report.tensors if not t.passed for d in t.diagnosis}
    assert causes == {"statistics_overflow"}
