"""Random input files for maskln (``maskln generate``): padded batches, as real dumps look.

Padding is trailing positions along the last leading axis, with a length per sequence, so a
``[batch, length, C]`` input looks like a padded batch of sequences. The same arguments always
give the same tensors (a seeded generator), and so the same file, byte for byte.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from maskln_cli.errors import MasklnError
from maskln_cli.resources import check_memory

if TYPE_CHECKING:
    import torch

GENERATE_DTYPES = ("float32", "float64", "float16", "bfloat16")


def parse_shape(text: str) -> tuple[int, ...]:
    """``"2,64,32"`` -> ``(2, 64, 32)``; the last axis (channels) must be at least 1.

    Example:
        >>> parse_shape("2, 64,32")
        (2, 64, 32)
    """
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise MasklnError(f"--shape: expected sizes like 2,64,32, got {text!r}") from None
    if any(size < 0 for size in shape):
        raise MasklnError(f"--shape: sizes cannot be negative, got {text!r}")
    if shape[-1] == 0:
        raise MasklnError(
            f"--shape: the last axis is the channels and needs at least 1, got {text!r}"
        )
    return shape


def padding_mask(
    leading: tuple[int, ...], invalid: float, generator: torch.Generator
) -> torch.Tensor:
    """A bool mask of shape ``leading``: each sequence (last axis) valid, then padded.

    Exactly ``round(invalid * positions)`` positions are padding, spread unevenly over the
    sequences so that their lengths differ, as in a real batch.

    Example:
        >>> import torch
        >>> padding_mask((2, 4), 0.25, torch.Generator().manual_seed(0)).sum().item()
        6
    """
    import torch

    if not 0.0 <= invalid <= 1.0:
        raise MasklnError(f"--invalid: must be a fraction from 0 to 1, got {invalid}")
    if not leading:  # a single position: padded when most of it would be
        return torch.tensor(invalid < 0.5)
    length = leading[-1]
    sequences = math.prod(leading[:-1])
    if sequences * length == 0:
        return torch.ones(leading, dtype=torch.bool)
    total = round(invalid * sequences * length)
    weights = 0.5 + torch.rand(sequences, generator=generator, dtype=torch.float64)
    padding = torch.floor(total * weights / weights.sum()).long().clamp_(max=length)
    order = torch.randperm(sequences, generator=generator)
    shortfall = total - int(padding.sum())
    while shortfall > 0:  # hand the remainder out one position at a time, where there is room
        for index in order.tolist():
            if shortfall and padding[index] < length:
                padding[index] += 1
                shortfall -= 1
    lengths = length - padding
    positions = torch.arange(length)
    return (positions < lengths[:, None]).reshape(leading)


def generate_inputs(
    shape: tuple[int, ...],
    dtype: str = "float32",
    seed: int = 0,
    invalid: float = 0.25,
    poison: bool = False,
    grad: bool = False,
) -> dict[str, torch.Tensor]:
    """Random ``x``, ``valid``, ``scale``, ``bias`` (and ``grad_out`` with ``grad``).

    With ``poison``, padded positions of x hold NaN, +inf and -inf in turn; otherwise they hold
    random values like the rest.

    Example:
        >>> tensors = generate_inputs((2, 5, 3), seed=1)
        >>> {k: list(v.shape) for k, v in tensors.items()}
        {'x': [2, 5, 3], 'valid': [2, 5], 'scale': [3], 'bias': [3]}
    """
    import torch

    if dtype not in GENERATE_DTYPES:
        raise MasklnError(f"--dtype: must be one of {', '.join(GENERATE_DTYPES)}, got {dtype!r}")
    target = getattr(torch, dtype)
    sample_dtype = torch.float64 if target == torch.float64 else torch.float32
    # x is sampled, possibly poisoned (a copy) and cast (a copy); grad_out sampled and cast.
    per_element = (2 + grad) * (sample_dtype.itemsize + target.itemsize)
    check_memory(math.prod(shape) * per_element, f"--shape {','.join(map(str, shape))}")
    generator = torch.Generator().manual_seed(seed)
    channels = shape[-1]
    valid = padding_mask(shape[:-1], invalid, generator)
    x = torch.randn(shape, generator=generator, dtype=sample_dtype)
    if poison:
        junk = torch.tensor([math.nan, math.inf, -math.inf], dtype=sample_dtype)
        filler = junk.repeat(math.ceil(x.numel() / 3) if x.numel() else 0)[: x.numel()]
        x = torch.where(valid[..., None], x, filler.reshape(shape))
    tensors = {
        "x": x.to(target),
        "valid": valid,
        "scale": (1.0 + 0.1 * torch.randn(channels, generator=generator)).to(target),
        "bias": (0.1 * torch.randn(channels, generator=generator)).to(target),
    }
    if grad:
        tensors["grad_out"] = torch.randn(shape, generator=generator, dtype=sample_dtype).to(target)
    return tensors
