"""NaN from the padding is named only where no clean padding row would give it: F.layer_norm in
float16 at eps 1e-12, its padding zeroed first, still makes NaN (a zero row's rstd, 1e6,
overflows float16), yet with NaN or inf in the padding it was told "NaN or inf from the padding
of x reaches grad_scale ... sanitize x", a fix it had made (found by a hunt for wrong causes).
Where 1 / sqrt(eps) is finite in the kernel's dtype the padding is still named."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from maskln_cli.testing import check_kernel


def layer_norm_padding_zeroed(x, valid, scale, bias, eps):
    x = x.masked_fill(~valid[..., None], 0)
    return F.layer_norm(x, x.shape[-1:], scale, bias, eps).masked_fill(~valid[..., None], 0)


def layer_norm_padding_kept(x, valid, scale, bias, eps):
    return F.layer_norm(x, x.shape[-1:], scale, bias, eps).masked_fill(~valid[..., None], 0)


def verdict(kernel, fill, eps, channels=8):
    x = torch.full((2, channels), fill, dtype=torch.float16)
    x[1] = torch.arange(channels, dtype=torch.float16)
    valid = torch.tensor([False, True])
    scale, bias = torch.ones(channels).half(), torch.zeros(channels).half()
    grad_out = torch.ones(2, channels, dtype=torch.float16)
    with warnings.catch_warnings(), pytest.raises(AssertionError) as raised:
        warnings.simplefilter("ignore")
        check_kernel(kernel, x, valid, scale, bias, eps, grad_out)
    return str(raised.value).splitlines()[0]


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_a_nan_a_clean_padding_row_gives_too_is_not_blamed_on_the_padding(fill):
    said = verdict(layer_norm_padding_zeroed, fill, 1e-12)
    assert "from the padding" not in said, said


def test_a_nan_from_the_padding_is_still_named_where_a_clean_row_is_finite():
    said = verdict(layer_norm_padding_kept, float("nan"), 1e-5)
    assert "from the padding of x" in said, said
