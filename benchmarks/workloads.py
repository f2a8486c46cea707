"""The benchmark cases and the two contenders, shared by bench.py and memory_probe.py.

"ours" is ``maskln_cli.masked_layer_normalization``; "peer" is the torch one-liner a user
would otherwise write: ``F.layer_norm(...)`` followed by ``masked_fill`` of the invalid rows.
For RMSNorm (figures 18 and 19), ``maskln_cli.masked_rms_normalization`` against both peers of
issue 39: the plain one-liner LLaMA's code writes, and torch's own ``F.rms_norm``, each followed
by ``masked_fill`` (bias unused).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from maskln_cli import masked_layer_normalization, masked_rms_normalization

EPS = 1e-5
RMS_EPS = 1e-6  # LLaMA's rms_norm_eps and the op's default
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


def ours_rms(inputs: Inputs) -> torch.Tensor:
    """maskln's RMSNorm op."""
    return masked_rms_normalization(inputs.x, inputs.valid, inputs.scale, RMS_EPS)


def peer_rms_plain(inputs: Inputs) -> torch.Tensor:
    """The plain-ops one-liner of LLaMA-family code, then zero the invalid rows."""
    x = inputs.x
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * inputs.scale
    return out.masked_fill(~inputs.valid[..., None], 0)


def peer_rms_torch(inputs: Inputs) -> torch.Tensor:
    """torch's own rms_norm, then zero the invalid rows."""
    x = inputs.x
    out = F.rms_norm(x, (x.shape[-1],), inputs.scale, RMS_EPS)
    return out.masked_fill(~inputs.valid[..., None], 0)


RMS_CONTENDERS: dict[str, Contender] = {
    "ours": ours_rms,
    "plain": peer_rms_plain,
    "F.rms_norm": peer_rms_torch,
}
RMS_PEERS: dict[str, Contender] = {"plain": peer_rms_plain, "F.rms_norm": peer_rms_torch}
