"""fit_rows given its row sums (grad_x's, from the term regressions' row products) fits as it
does from its own."""

from __future__ import annotations

import pytest
import torch

from maskln_cli.verify.systematic import fit_rows


def test_fit_rows_takes_the_row_sums_it_is_given():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(32, 64, generator=g, dtype=torch.float64)
    error = 2e-3 * z + 1e-4 + 1e-6 * torch.randn(z.shape, generator=g, dtype=torch.float64)
    rstd = torch.ones(32, dtype=torch.float64)
    second = torch.zeros(32, dtype=torch.float64)
    sums = (z.sum(dim=1), error.sum(dim=1), (z * error).sum(dim=1))
    given = fit_rows(error, z, rstd, 1e-5, second, row_sums=sums)
    own = fit_rows(error, z, rstd, 1e-5, second)
    assert given.rows == own.rows == 32
    for name in ("w", "wf", "wff", "v", "vg", "vgg"):
        assert getattr(given, name) == getattr(own, name)
    assert given.wf / given.w == pytest.approx(2e-3, rel=1e-3)
    assert given.vg / given.v == pytest.approx(1e-4, rel=1e-2)


def test_fit_rows_written_in_place_fits_as_on_copies():
    """writable: z and error made in place (out's fit in verify) give the same bits."""
    g = torch.Generator().manual_seed(4)
    z = torch.randn(32, 64, generator=g, dtype=torch.float64)
    error = 2e-3 * z + 1e-4 + 1e-6 * torch.randn(z.shape, generator=g, dtype=torch.float64)
    rstd = 1 + torch.rand(32, generator=g, dtype=torch.float64)
    second = 1e-9 * torch.rand(32, generator=g, dtype=torch.float64)
    offset = torch.rand(32, generator=g, dtype=torch.float64)
    shifted = 1 + 0.1 * torch.randn(64, generator=g, dtype=torch.float64)
    stored = 1e-8 * torch.rand(32, generator=g, dtype=torch.float64)
    common = (rstd, 1e-5, second, None, offset, 1e-7, stored, 5, shifted)
    apart = fit_rows(error, z, *common)
    written = fit_rows(error.clone(), z.clone(), *common, writable=True)
    assert written.rows == apart.rows == 32
    for name, value in vars(apart).items():
        if name == "kept":
            assert all(torch.equal(a, b) for a, b in zip(value, written.kept, strict=True))
        else:
            assert getattr(written, name) == value, name
