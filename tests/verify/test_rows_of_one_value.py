"""Rows of one value (x = 1e4 + N(0, 1) stored in float16 or bfloat16, whose spacing there is 8
or 64) have a normalized part of 0: what a kernel leaves of them tells few formulas apart.
- NaN on every such row is a 0/0 (eps missing) as much as a half accumulator's overflow (64
  values of 1e4 sum beyond float16's 65,504): a float16 kernel accumulating its row sums in
  float16 was told "eps missing" (48 of 48 hunt cases).
- xhat = 1 on every such row is what leaving the mean out gives (RMS normalization) as much as
  a mean that is off by anything, a bfloat16 accumulator's rounding included: such a kernel
  was told "mean not subtracted (RMS normalization)" (18 of 18).
Neither is named there now; each still is where the rows tell it apart."""

from __future__ import annotations

import pytest
import torch

from maskln_cli.testing import verify
from tests import kernels

HALF = ("float16", "bfloat16")


def _named(kernel, inputs, names=("out",)) -> set[str]:
    result = kernels.run(kernel, inputs)
    report = verify(
        result["out"], inputs["x"], inputs["valid"], inputs["scale"], inputs["bias"],
        kernels.EPS, grad_out=inputs["grad_out"], grad_x=result["grad_x"],
        grad_scale=result["grad_scale"], grad_bias=result["grad_bias"],
    )  # fmt: skip
    return {
        d["mistake"]
        for t in report.tensors
        if t.name in names and not t.passed
        for d in t.diagnosis
    }


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("channels", [8, 64])
@pytest.mark.parametrize("dtype", HALF)
def test_nan_from_a_float16_accumulator_on_rows_of_one_value_is_not_eps_missing(
    dtype, channels, seed
):
    """In a float16 kernel, or a bfloat16 one (whose own float32 range holds the sums)."""
    inputs = kernels.offset_batch(1e4, seed, (2, 12, channels), dtype)
    named = _named(kernels.accumulate_in(torch.float16), inputs, ("out", "grad_x"))
    assert "eps_missing" not in named, named


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("channels", [8, 64])
def test_a_bfloat16_accumulators_mean_on_rows_of_one_value_is_not_rms_norm(channels, seed):
    inputs = kernels.offset_batch(1e4, seed, (2, 12, channels), "bfloat16")
    named = _named(kernels.accumulate_in(torch.bfloat16), inputs)
    assert "rms_norm" not in named, named


@pytest.mark.parametrize(
    "dtype, offset", [("float32", 3.0), ("float32", 1e4), ("float16", 1.0), ("bfloat16", 1.0)]
)
def test_eps_missing_is_still_named_on_rows_of_one_value(dtype, offset):
    """NaN on rows of one value no accumulator of the kernel's dtype overflows on: eps."""
    inputs = kernels.offset_batch(offset, 0, (2, 12, 8), dtype, std=0.0)
    assert "eps_missing" in _named(kernels.with_eps(0.0), inputs)


def test_rms_norm_is_still_named_on_rows_of_many_values():
    inputs = kernels.offset_batch(3.0, 0, (2, 12, 64), "float32")
    assert "rms_norm" in _named(kernels.mean_not_subtracted, inputs)
