"""The error budget's pieces, on inputs whose figures are known."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from maskln_cli.op.reference import reference_masked_layer_norm
from maskln_cli.verify import budget
from maskln_cli.verify.budget import Precision, RowBudget, SumBudget
from maskln_cli.verify.yardstick import yardstick


def test_unit_roundoffs_and_what_rounds_on_the_way_in():
    half = Precision.of(torch.bfloat16, x_dtype=torch.float32, param_dtype=torch.bfloat16)
    # bfloat16 kernels reduce in float32 and store in bfloat16; float32 x is rounded on the
    # way in (x and the row mean: twice), bfloat16 parameters are not.
    assert (half.reduce, half.store, half.x, half.params) == (2**-24, 2**-8, 2**-7, 0.0)
    single = Precision.of(torch.float32, x_dtype=torch.bfloat16, grad_out_dtype=torch.float64)
    assert (single.reduce, single.store, single.x, single.grad_out) == (2**-24, 2**-24, 0, 2**-24)


def rows_at(offset, spread=1.0, channels=64, rows=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return offset + spread * torch.randn(rows, channels, generator=generator, dtype=torch.float64)


def test_out_model_grows_with_the_offset_and_covers_torch():
    """A row of mean m and spread s loses about log10(m / s) digits to the mean's rounding:
    the model grows in proportion, and PyTorch's own float32 error stays within it."""
    one, zero = torch.ones(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
    valid = torch.ones(32, dtype=torch.bool)
    models = []
    for offset in (0.0, 1e2, 1e4):
        x = rows_at(offset).float().double()  # data stored in float32
        model = RowBudget(x, valid, one, zero, 1e-5, Precision.of(torch.float32)).out()
        truth = reference_masked_layer_norm(x, valid, one, zero)
        torch_error = (F.layer_norm(x.float(), (64,)).double() - truth).abs()
        assert bool((torch_error <= model).all())
        models.append(float(model.median()))
    assert models[0] < models[1] < models[2]
    assert models[2] / models[1] == pytest.approx(100, rel=0.2)


def test_invalid_rows_are_allowed_nothing():
    x = rows_at(0.0, rows=4)
    valid = torch.tensor([True, False, True, False])
    one, zero = torch.ones(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
    rows = RowBudget(x, valid, one, zero, 1e-5, Precision.of(torch.float32))
    assert bool((rows.out()[~valid] == 0).all()) and bool((rows.out()[valid] > 0).all())
    dy = torch.randn(4, 64, dtype=torch.float64)
    assert bool((rows.grad_x(dy)[~valid] == 0).all())
    allowed = budget.allowance(rows.out(), None, x, torch.float32, 3.0, 1.3e-6, 1e-5, valid)
    assert bool((allowed[~valid] == 0).all()) and bool((allowed[valid] >= 1e-5).all())


def test_the_yardstick_raises_a_budget_and_never_lowers_it():
    model = torch.tensor([1e-6, 1e-6, 1e-6], dtype=torch.float64)
    yardstick = torch.tensor([0.0, 1e-7, 1e-5], dtype=torch.float64)  # exact by luck, below, above
    truth = torch.zeros(3, dtype=torch.float64)
    allowed = budget.allowance(model, yardstick, truth, torch.float64, 2.0, 0.0, 0.0)
    assert allowed.tolist() == [2e-6, 2e-6, 2e-5]
    # NaN or inf from the data raise nothing
    odd = torch.tensor([math.nan, math.inf, 0.0], dtype=torch.float64)
    assert budget.unit(model, odd).tolist() == [1e-6, 1e-6, 1e-6]


def test_within_the_fixed_tolerance_or_a_few_ulps_always_passes():
    truth = torch.tensor([1.0, 1000.0], dtype=torch.float64)
    tiny = torch.zeros(2, dtype=torch.float64)
    allowed = budget.allowance(tiny, None, truth, torch.float32, 3.0, 1.3e-6, 1e-5)
    assert allowed.tolist() == [1e-5 + 1.3e-6, 1e-5 + 1.3e-3]
    allowed = budget.allowance(tiny, None, truth, torch.bfloat16, 3.0, 0.0, 0.0)
    # bfloat16's spacing is 2**-7 at 1 and 4 at 1000 (in [512, 1024)): ULPS of them, at least
    for value, spacing, allows in zip((1.0, 1000.0), (2**-7, 4.0), allowed.tolist(), strict=True):
        assert budget.ULPS * spacing <= allows <= 2 * budget.ULPS * spacing
        rounded = torch.tensor(value + spacing, dtype=torch.bfloat16).item()
        assert rounded == value + spacing  # it is the spacing: the next number up


def test_factor_needed_counts_only_what_the_floor_does_not_cover():
    error = torch.tensor([1.0, 6.0, 0.5], dtype=torch.float64)
    unit = torch.tensor([0.1, 2.0, 0.01], dtype=torch.float64)
    always = torch.tensor([2.0, 1.0, 1.0], dtype=torch.float64)
    assert budget.factor_needed(error, unit, always) == 3.0  # only the middle element counts
    assert budget.factor_needed(error, unit, always * 10) == 0.0


def test_sum_models_cover_a_sequential_float32_sum():
    """grad_bias summed row by row in float32 (a naive accumulation) stays within the model,
    for terms of one sign (partial sums drift) and of random signs."""
    generator = torch.Generator().manual_seed(4)
    for drift in (0.0, 1.0):
        terms = drift + torch.randn(4096, 16, generator=generator, dtype=torch.float64)
        terms = terms.float().double()
        sums = SumBudget(16, Precision.of(torch.float32))
        sums.rows = 4096
        sums.bias_squares = terms.square().sum(0)
        total = torch.zeros(16, dtype=torch.float32)
        for row in terms.float():
            total = total + row
        truth = terms.sum(0)
        assert bool(((total.double() - truth).abs() <= sums.grad_bias(truth)).all())


def test_yardstick_zeroes_the_padding_first():
    x = torch.tensor([[1.0, 3.0], [math.nan, math.inf]])
    valid = torch.tensor([True, False])
    grad_out = torch.tensor([[1.0, -1.0], [math.nan, 1.0]])
    scale, bias = torch.tensor([2.0, 1.0]), torch.tensor([0.5, 0.5])
    guess = yardstick(x, valid, scale, bias, 1e-5, torch.float32, grad_out)
    assert guess.out[1].tolist() == [0.0, 0.0] and guess.grad_x is not None
    assert bool(guess.grad_x.isfinite().all()) and bool(guess.grad_scale.isfinite().all())
    assert guess.grad_bias.tolist() == [1.0, -1.0]  # the valid row's upstream gradient alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_the_models_made_in_few_passes_are_their_terms(dtype, offset):
    """out's model and grad_x's are each made as one per-row combination (fewer passes over
    the rows): they are the formulas term by term, to float64's rounding, the padding 0."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(33, 96, generator=g, dtype=torch.float64) * 3 + offset
    x[5] = math.nan  # padding holding NaN
    valid = torch.rand(33, generator=g) > 0.2
    valid[5] = False
    scale = torch.randn(96, generator=g, dtype=torch.float64)
    bias = torch.randn(96, generator=g, dtype=torch.float64)
    dy = torch.randn(33, 96, generator=g, dtype=torch.float64)
    rows = RowBudget(x, valid, scale, bias, 1e-5, Precision.of(dtype, x_dtype=torch.float64))
    keep = valid.unsqueeze(1)
    p = rows.precision
    xhat, scaled = rows.xhat, (rows.xhat * scale).abs()
    out = (
        rows.offset * scale.abs() * rows.e0
        + scaled * (rows.e0 + rows.e2 + p.reduce + p.params)
        + bias.abs() * (p.reduce + p.params)
        + (xhat * scale + bias).abs() * p.store
    ).masked_fill(~keep, 0.0)
    torch.testing.assert_close(rows.out(), out, rtol=1e-13, atol=0.0)
    truth = torch.where(keep, xhat * scale + bias, 0.0)
    torch.testing.assert_close(rows.out(truth), out, rtol=1e-13, atol=0.0)
    terms = sum(budget.grad_x_terms(rows, dy).values())
    grad_x = (terms * rows.growth).masked_fill(~keep, 0.0)
    torch.testing.assert_close(rows.grad_x(dy), grad_x, rtol=1e-13, atol=0.0)
    assert (rows.grad_x(dy)[~valid] == 0).all() and (rows.grad_x(dy)[valid] > 0).all()
