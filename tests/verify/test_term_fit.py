"""grad_x's term regressions (maskln_cli.verify.terms): the row sums' fit against an independent
least-squares fit per row, and the rule that a standard error within float64's rounding of the
sums it comes from is 0, while a real small one still shows."""

from __future__ import annotations

import math

import pytest
import torch

from maskln_cli.verify.terms import (
    Pool,
    constant_bounds,
    fit_terms,
    pooled_error,
    pooled_terms,
    row_products,
)


def _rows(rows: int = 64, channels: int = 48, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, channels, generator=g, dtype=torch.float64) * 3 + 2
    wdy = torch.randn(rows, channels, generator=g, dtype=torch.float64)
    var = x.var(dim=1, correction=0)
    rstd = (var + 1e-5).rsqrt()
    xhat = (x - x.mean(dim=1, keepdim=True)) * rstd[:, None]
    c1 = (xhat * wdy).mean(dim=1, keepdim=True)
    c2 = wdy.mean(dim=1, keepdim=True)
    truth = rstd[:, None] * (wdy - xhat * c1 - c2)
    t_xhat = rstd[:, None] * xhat * c1
    t_mean = (rstd[:, None] * c2).expand_as(truth)
    return truth, xhat, wdy, rstd, t_xhat, t_mean


def test_each_rows_coefficients_are_a_least_squares_fit_on_its_terms():
    truth, xhat, wdy, rstd, t_xhat, t_mean = _rows()
    g = torch.Generator().manual_seed(1)
    known = torch.tensor([0.3, -0.7, 0.2], dtype=torch.float64)
    noise = 1e-3 * torch.randn(truth.shape, generator=g, dtype=torch.float64)
    basis = torch.stack((truth, t_xhat, t_mean), dim=2)  # [R, C, 3]
    error = basis @ known + noise * truth.abs().mean()
    rows = torch.ones(len(truth), dtype=torch.bool)
    sums = fit_terms(error, truth, xhat, wdy, rstd, rows)
    # Independently: each row's least squares, pooled with the same weights.
    solved = torch.linalg.lstsq(basis, error.unsqueeze(2)).solution.squeeze(2)  # [R, 3]
    information = 1 / torch.linalg.inv(basis.transpose(1, 2) @ basis).diagonal(dim1=1, dim2=2)
    for k, name in enumerate(("xhat", "mean"), start=1):
        w, a = information[:, k], solved[:, k]
        expected = float((w * a).sum() / w.sum())
        assert sums.pools[name].mean() == pytest.approx(expected, rel=1e-9)
        assert abs(sums.pools[name].mean() - float(known[k])) < 0.05
    assert sums.rows == len(truth)


@pytest.mark.parametrize("term", ["xhat", "mean"])
def test_a_term_missing_exactly_has_a_standard_error_of_0(term):
    # Every row's coefficient is 1 to float64's last bits: what the pooled sums leave is their
    # own cancellation, not a spread (before: printed as "± 9e-10" or so).
    truth, xhat, wdy, rstd, t_xhat, t_mean = _rows(rows=512)
    error = t_xhat if term == "xhat" else t_mean
    sums = fit_terms(error.clone(), truth, xhat, wdy, rstd, torch.ones(512, dtype=torch.bool))
    pool = sums.pools[term]
    assert pool.mean() == pytest.approx(1.0, abs=1e-12)
    assert pool.error() == 0.0
    # The uncapped formula does find cancellation noise here: the rule is what zeroes it.
    a = pool.mean()
    raw = pool.w2aa - 2 * a * pool.w2a + a * a * pool.w2
    assert raw <= (pool.n + 4) * 2.0**-53 * 4 * pool.w2aa


def test_a_real_small_standard_error_still_shows():
    g = torch.Generator().manual_seed(2)
    rows = 2000
    a = 1 + 1e-5 * torch.randn(rows, generator=g, dtype=torch.float64)
    w = torch.rand(rows, generator=g, dtype=torch.float64) + 0.5
    pool = Pool.of(a, w, torch.zeros(rows, dtype=torch.float64))
    expected = float(((w**2 * (a - (w * a).sum() / w.sum()) ** 2).sum()).sqrt() / w.sum())
    assert expected > 1e-7
    assert pool.error() == pytest.approx(expected, rel=1e-3)


def test_pooled_error_zeroes_only_what_the_sums_round_by():
    size = 4.0  # w2aa + 2 |a| sqrt(w2 w2aa) + a**2 w2 at a = w2 = w2aa = 1
    rows = 10
    bound = (rows + 4) * 2.0**-53 * size
    assert pooled_error(1.0, 1.0, 1.0, 1.0 + 0.9 * bound, 1.0, rows) == 0.0
    above = pooled_error(1.0, 1.0, 1.0, 1.0 + 4 * bound, 1.0, rows)
    assert above == pytest.approx(math.sqrt(4 * bound), rel=1e-6)


def test_row_products_are_each_rows_sums_of_products_of_its_four_rows():
    truth, xhat, wdy, _, _, _ = _rows()
    error = 1e-3 * truth + 1e-4
    products, plain = row_products(truth, xhat, error, wdy)
    named = (truth, xhat, error, wdy)
    for i, a in enumerate(named):
        assert torch.allclose(plain[:, i], a.sum(dim=1), rtol=1e-12, atol=0)
        for j, b in enumerate(named):
            expected = (a * b).sum(dim=1)
            assert torch.allclose(products[:, i, j], expected, rtol=1e-12, atol=1e-12)


def test_fit_terms_takes_the_row_products_it_is_given():
    truth, xhat, wdy, rstd, t_xhat, _ = _rows()
    error = 1e-3 * t_xhat + 1e-6 * truth
    rows = torch.ones(len(truth), dtype=torch.bool)
    given = fit_terms(error, truth, xhat, wdy, rstd, rows,
                      products=row_products(truth, xhat, error, wdy))  # fmt: skip
    own = fit_terms(error, truth, xhat, wdy, rstd, rows)
    assert given.rows == own.rows == len(truth)
    for name in ("xhat", "mean"):
        assert given.pools[name].mean() == own.pools[name].mean()
        assert given.pools[name].mean() == pytest.approx(1e-3 if name == "xhat" else 0, abs=1e-9)


def test_each_rows_constant_is_judged_against_its_own_bound():
    """A constant of a random sign on each row, k_r times that row's bound: the finding's score
    is the rms of k_r, its worst the largest, and it is systematic beyond CONSTANT_LIMIT."""
    truth, xhat, wdy, rstd, _, _ = _rows()
    channels = truth.shape[1]
    g = torch.Generator().manual_seed(2)
    rounding = 1e-6 * (1 + torch.rand(len(truth), generator=g, dtype=torch.float64))
    c1, c2 = (xhat * wdy).mean(dim=1), wdy.mean(dim=1)
    n = c1.abs() + c2.abs() + 2 * wdy.square().mean(dim=1).sqrt() / math.sqrt(channels)
    bound = rounding * n / wdy.square().mean(dim=1).sqrt()  # independently of constant_bounds
    bound += 2 * rounding / math.sqrt(channels)
    assert constant_bounds(rounding, c1, c2, wdy.square().sum(dim=1), channels) == (
        pytest.approx(bound, rel=1e-12)
    )
    rows = torch.ones(len(truth), dtype=torch.bool)
    for size, systematic in ((0.1, False), (0.6, True)):
        k = size * torch.randn(len(truth), generator=g, dtype=torch.float64)
        error = (k * bound)[:, None].expand_as(truth)
        found = pooled_terms(fit_terms(error, truth, xhat, wdy, rstd, rows, rounding), 1.0)
        assert found is not None
        assert found.constant_score == pytest.approx(float(k.square().mean().sqrt()), rel=1e-9)
        assert found.constant_worst == pytest.approx(float(k.abs().max()), rel=1e-9)
        assert found.constant_beyond == int((k.abs() > 1).sum())
        assert found.systematic_constant is systematic
        assert found.systematic is systematic  # the term coefficients are within the gate 1


def test_a_floor_of_rounding_bounds_each_rows_constant():
    """An error of ``floor`` on every element alike (the most rounding to the nearest
    subnormal gives) is within each row's constant bound, however small the rows' other
    rounding; without the floor, far beyond it."""
    truth, xhat, wdy, rstd, _, _ = _rows()
    channels, floor = truth.shape[1], 2.0**-25
    rounding = torch.full((len(truth),), 1e-12, dtype=torch.float64)
    c1, c2 = (xhat * wdy).mean(dim=1), wdy.mean(dim=1)
    squares = wdy.square().sum(dim=1)
    assert constant_bounds(rounding, c1, c2, squares, channels, floor) == pytest.approx(
        constant_bounds(rounding, c1, c2, squares, channels) + floor, rel=1e-12
    )
    error = torch.full_like(truth, floor)
    rows = torch.ones(len(truth), dtype=torch.bool)
    found = pooled_terms(fit_terms(error, truth, xhat, wdy, rstd, rows, rounding, None, floor), 1)
    assert found is not None and 0.99 < found.constant_worst <= 1.0
    found = pooled_terms(fit_terms(error, truth, xhat, wdy, rstd, rows, rounding), 1.0)
    assert found is not None and found.constant_worst > 1e3
