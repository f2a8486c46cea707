"""Dtype, precision and parameter mistakes, written as people write them (issue 22's diagnosis
cases): each is one mistake that fails many clauses, which the report must name once, as the
root cause, with a fix a student can act on.
"""

import torch
from torch import nn

from tests.solutions.correct import masked_layer_normalization as correct


def output_hard_coded_float32(x, valid, scale, bias, eps=1e-05):
    """The output buffer is allocated as float32, whatever x's dtype."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    out.copy_(correct(x, valid, scale, bias, eps))
    return out


def float64_computed_in_float32(x, valid, scale, bias, eps=1e-05):
    """Computes in float32 "because GPUs do", then returns x's dtype."""
    return correct(x.float(), valid, scale.float(), bias.float(), eps).to(x.dtype)


def float32_computed_in_float64(x, valid, scale, bias, eps=1e-05):
    """Computes in float64 for accuracy and never casts back."""
    return correct(x.double(), valid, scale.double(), bias.double(), eps)


def computed_in_float16(x, valid, scale, bias, eps=1e-05):
    """Computes in float16 "for speed", in float32 where float16 has no kernel, and returns x's
    dtype."""
    y = correct(x.half().float(), valid, scale.half().float(), bias.half().float(), eps)
    return y.half().to(x.dtype)


def reinitializes_parameters(x, valid, scale, bias, eps=1e-05):
    """Initializes the layer's parameters, as an nn.Module's reset_parameters does: ones and
    zeros, in place."""
    nn.init.ones_(scale)
    nn.init.zeros_(bias)
    return correct(x, valid, scale, bias, eps)


def zeroes_bias_in_place(x, valid, scale, bias, eps=1e-05):
    """Resets bias with nn.init.zeros_ ("bias starts at zero"): every output is then exactly
    what a missing bias gives, but the cause is the reinitialization."""
    with torch.no_grad():
        nn.init.zeros_(bias)
    return correct(x, valid, scale, bias, eps)
