"""The benchmark cases and the two contenders, shared by bench.py and memory_probe.py.

"ours" is ``maskln_cli.masked_layer_normalization``; "peer" is the torch one-liner a user
would otherwise write: ``F.layer_norm(...)`` followed by ``masked_fill`` of the invalid rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from maskln_cli import masked_layer_normalization

EPS = 1e-5
THREADS = 2
INVALID_FRACTION = 0.25

SHAPES: tuple[tuple[int, ...], ...] = ((131072, 128), (8192, 1024), (16, 128, 384), (524288, 16))
DTYPES: tuple[str, ...] = ("float32", "float64")


@dataclass(frozen=True)
class Case:
    """One input shape and dtype."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def label(self) -> str:
        return f"{list(self.shape)} {self.dtype}"

    @property
    def rows(self) -> int:
        return self.numel // self.shape[-1]

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


CASES: tuple[Case, ...] = tuple(Case(shape, dtype) for shape in SHAPES for dtype in DTYPES)
TINY_SHAPES: tuple[tuple[int, ...], ...] = ((4096, 16), (8, 16, 64))
"""Calls where the per-call overhead dominates (target: <= 1.5x the peer, not 0.8x)."""
OP_CASES: tuple[Case, ...] = CASES + tuple(
    Case(shape, "float32") for shape in ((64, 512, 768), (32, 65536), *TINY_SHAPES)
)
"""The op's timing figures (1, 2, 13): the bench shapes and issue 21's extra float32 shapes."""


@dataclass(frozen=True)
class Inputs:
    """The arguments of one call: x [..., C], valid [...], scale [C], bias [C]."""

    x: torch.Tensor
    valid: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor


Contender = Callable[[Inputs], torch.Tensor]


def make_inputs(case: Case, seed: int = 0, requires_grad: bool = False) -> Inputs:
    """Random inputs for ``case``; about INVALID_FRACTION of the rows are invalid."""
    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    channels = case.shape[-1]
    x = torch.randn(case.shape, dtype=dtype, generator=generator)
    valid = torch.rand(case.shape[:-1], generator=generator) >= INVALID_FRACTION
    scale = 1 + 0.1 * torch.randn(channels, dtype=dtype, generator=generator)
    bias = 0.1 * torch.randn(channels, dtype=dtype, generator=generator)
    for tensor in (x, scale, bias):
        tensor.requires_grad_(requires_grad)
    return Inputs(x, valid, scale, bias)


def ours(inputs: Inputs) -> torch.Tensor:
    """maskln's op."""
    return masked_layer_normalization(inputs.x, inputs.valid, inputs.scale, inputs.bias, EPS)


def peer(inputs: Inputs) -> torch.Tensor:
    """The torch one-liner: layer_norm, then zero the invalid rows."""
    x = inputs.x
    out = F.layer_norm(x, (x.shape[-1],), inputs.scale, inputs.bias, EPS)
    return out.masked_fill(~inputs.valid[..., None], 0)


CONTENDERS: dict[str, Contender] = {"ours": ours, "peer": peer}
