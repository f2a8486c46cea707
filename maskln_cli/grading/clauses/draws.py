"""The random data of the cases, drawn from one generator per clause (:func:`generator`),
deterministic from the seed, so that the grader's child process and the grader draw the same.
Every draw is float64 (or bool), whatever torch's default dtype.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch


def generator(seed: int, clause: str) -> torch.Generator:
    """One generator per clause: a clause's cases do not change when another clause's do.
    (Every draw names its dtype: a function that changes torch's default dtype in the child
    must not change the cases the child builds.)"""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(clause.encode())) % 2**62)


def mask(g: torch.Generator, leading: Sequence[int], fraction: float = 0.7) -> torch.Tensor:
    """A random mask with at least one valid and one invalid row (when it has two rows)."""
    valid = torch.rand(tuple(leading), generator=g, dtype=torch.float64) < fraction
    flat = valid.view(-1)
    if flat.numel() >= 2:
        flat[0], flat[-1] = True, False
        flat.copy_(flat[torch.randperm(flat.numel(), generator=g)])
    return valid


def rows(
    g: torch.Generator,
    leading: Sequence[int],
    channels: int,
    spreads: Sequence[float] = (1.0,),
    offset: float = 1.0,
) -> torch.Tensor:
    """float64 rows ``mean + spread * randn``: row r takes ``spreads[r % len(spreads)]`` and a
    random mean within ``offset * spread`` (well conditioned for offset <= 2)."""
    rows = math.prod(leading)
    spread = torch.tensor(spreads, dtype=torch.float64).repeat(rows // len(spreads) + 1)[:rows]
    spread = spread * (0.5 + torch.rand(rows, generator=g, dtype=torch.float64))
    mean = offset * spread * (2 * torch.rand(rows, generator=g, dtype=torch.float64) - 1)
    noise = torch.randn(rows, channels, generator=g, dtype=torch.float64)
    return (mean[:, None] + spread[:, None] * noise).reshape(*leading, channels)


def params(
    g: torch.Generator, channels: int, negative_bias: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """scale around 1 (some entries negative) and bias of size at least 0.5."""
    scale = 1.0 + 0.6 * torch.randn(channels, generator=g, dtype=torch.float64)
    magnitude = 0.5 + torch.rand(channels, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(channels, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
    bias = -magnitude if negative_bias else sign * magnitude
    return scale, bias
