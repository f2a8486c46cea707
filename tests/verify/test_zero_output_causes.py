"""An output of zeros on rows that are all valid matches "the mask read the other way round"
(valid rows zeroed: there are no invalid rows to be normalized), and was named so for a Gemma
kernel whose gain rounded to 0 (found by a hunt for wrong causes). A padding mistake is
evidence only where there is padding: with every row valid it is not named."""

from __future__ import annotations

import torch

from maskln_cli.op.mistakes import diagnose_output


def test_zeros_on_all_valid_rows_are_not_an_inverted_mask():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=g, dtype=torch.float64)
    scale, bias = torch.ones(16), torch.zeros(16)
    for norm in ("layer", "rms"):
        found = diagnose_output(
            torch.zeros(4, 16), x, torch.ones(4, dtype=torch.bool), scale, bias, 1e-5, norm=norm
        )
        assert "mask_inverted" not in [d.mistake for d in found], (norm, found)


def test_an_inverted_mask_is_still_named_where_there_is_padding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=g, dtype=torch.float64)
    valid = torch.tensor([True, False, True, False])
    scale, bias = torch.ones(16), torch.zeros(16)
    inverted = torch.nn.functional.layer_norm(x, (16,), eps=1e-5) * valid.logical_not()[:, None]
    found = diagnose_output(inverted, x, valid, scale, bias, 1e-5)
    assert [d.mistake for d in found][:1] == ["mask_inverted"]
