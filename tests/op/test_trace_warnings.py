"""torch.jit.trace of the op and the module prints no TracerWarning from maskln's own code
(issue 33, item 6: the suite printed them from op/module.py and op/checks.py, whose shape
checks compare the example's sizes, as every Python condition in a trace does)."""

from __future__ import annotations

import warnings

import torch

from maskln_cli import MaskedLayerNorm, masked_layer_normalization


def tracer_warnings_of(function, *inputs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(function, inputs)
    ours = [
        f"{w.filename}:{w.lineno}"
        for w in caught
        if issubclass(w.category, torch.jit.TracerWarning) and "maskln_cli" in w.filename
    ]
    torch.testing.assert_close(traced(*inputs), function(*inputs))
    return ours


def test_tracing_the_module_and_the_op_warns_of_nothing_of_ours():
    x, valid = torch.randn(2, 3, 8), torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert tracer_warnings_of(MaskedLayerNorm(8), x, valid) == []
    scale, bias = torch.rand(8) + 0.5, torch.randn(8)
    assert tracer_warnings_of(masked_layer_normalization, x, valid, scale, bias) == []
