"""Tests of a masked layer-norm kernel, by maskln: examples/my_kernel.py's here, yours in its
place. Run them with

    python -m pytest examples/test_my_kernel.py

check_kernel calls the kernel on copies of the inputs and judges its output and its gradients
(by autograd) as `maskln verify --strict` judges files: each element within its error budget
of maskln's float64 result, the padding exactly +0.0, and every input left as it was given.
The strategy draws the inputs that break kernels (Hypothesis: pip install 'maskln[testing]').
"""

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from maskln_cli.testing import check_kernel
from maskln_cli.testing.strategies import layer_norm_inputs

sys.path.insert(0, str(Path(__file__).parent))  # my_kernel.py lies beside this file
from my_kernel import masked_layer_normalization as kernel  # yours here


@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_a_padded_batch(offset):
    """Sequences of different lengths, their padding full of NaN; rows about ``offset``."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 128, 64, generator=generator) + offset
    lengths = torch.randint(1, 129, (8, 1), generator=generator)
    valid = torch.arange(128) < lengths
    x[~valid] = float("nan")
    scale, bias = torch.randn(64, generator=generator), torch.randn(64, generator=generator)
    grad_out = torch.randn(8, 128, 64, generator=generator)
    check_kernel(kernel, x, valid, scale, bias, 1e-5, grad_out)


@settings(max_examples=150, deadline=None)
@given(layer_norm_inputs([torch.float32, torch.float64], grad_out=True))
def test_the_inputs_that_break_kernels(inputs):
    check_kernel(kernel, *inputs)
