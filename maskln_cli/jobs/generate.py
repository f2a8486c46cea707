"""Random input files for maskln (``maskln generate``): padded batches, as real dumps look.

Padding is trailing positions along the last leading axis, with a length per sequence, so a
``[batch, length, C]`` input looks like a padded batch of sequences. The same arguments always
give the same tensors (a seeded generator), and so the same file, byte for byte.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from maskln_cli.errors import MasklnError
from maskln_cli.files.resources import check_memory
from maskln_cli.files.tensorfile import dtype_name

if TYPE_CHECKING:
    import torch

GENERATE_DTYPES = ("float32", "float64", "float16", "bfloat16")
VALID_DTYPES = ("bool", "int64", "uint8")
"""dtypes of the mask: real attention masks come as integers."""
SAMPLE_CHUNK = 1 << 20
"""Elements sampled at a time (a multiple of 16: see :func:`sample_normal`)."""

Progress = Callable[[int, int], None]
"""Called with (work done, total work), in bytes."""


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


def sample_normal(
    shape: tuple[int, ...],
    generator: torch.Generator,
    dtype: torch.dtype,
    offset: float = 0.0,
    std: float = 1.0,
    advance: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """``offset + std * torch.randn(shape)``, sampled :data:`SAMPLE_CHUNK` elements at a time so
    that progress can be shown; ``advance`` is told the elements of each chunk done.

    The values are those of one whole ``torch.randn`` call, bit for bit: torch draws uniforms in
    order and transforms them 16 at a time, redoing the last 16 of a size that is not a
    multiple of 16, so chunks of a multiple of 16 with a last chunk of at least 16 elements
    draw the same numbers (tests check it). ``offset + std * z`` is computed in float64 and
    rounded once to ``dtype``.

    Example:
        >>> import torch
        >>> whole = torch.randn(100, generator=torch.Generator().manual_seed(3))
        >>> chunked = sample_normal((100,), torch.Generator().manual_seed(3), torch.float32)
        >>> torch.equal(whole, chunked)
        True
    """
    import torch

    numel = math.prod(shape)
    flat = torch.empty(numel, dtype=dtype)
    start = 0
    while start < numel:
        stop = min(numel, start + SAMPLE_CHUNK)
        if numel - stop < 16:  # a last chunk under 16 would be drawn differently: fold it in
            stop = numel
        chunk = torch.randn(stop - start, generator=generator, dtype=dtype)
        if offset != 0.0 or std != 1.0:  # skipped by default: the same bits as ever
            chunk = (chunk.double() * std + offset).to(dtype)
        flat[start:stop] = chunk
        if advance:
            advance(stop - start)
        start = stop
    return flat.reshape(shape)


def generate_inputs(
    shape: tuple[int, ...],
    dtype: str = "float32",
    seed: int = 0,
    invalid: float = 0.25,
    poison: bool = False,
    grad: bool = False,
    offset: float = 0.0,
    std: float = 1.0,
    valid_dtype: str = "bool",
    progress: Progress | None = None,
    norm: str = "layer",
) -> dict[str, torch.Tensor]:
    """Random ``x``, ``valid``, ``scale``, ``bias`` (and ``grad_out`` with ``grad``); for
    ``norm`` ``'rms'`` the same tensors without ``bias`` (RMSNorm has none).

    x is ``offset + std * N(0, 1)`` on every position (a large common offset is where float32
    kernels and one-pass variances part ways). With ``poison``, padded positions of x hold NaN,
    +inf and -inf in turn; otherwise they hold random values like the rest. ``valid`` is bool,
    int64 or uint8 (0/1). ``progress`` is told the bytes of x and grad_out sampled so far.

    Example:
        >>> tensors = generate_inputs((2, 5, 3), seed=1)
        >>> {k: list(v.shape) for k, v in tensors.items()}
        {'x': [2, 5, 3], 'valid': [2, 5], 'scale': [3], 'bias': [3]}
    """
    import torch

    if dtype not in GENERATE_DTYPES:
        raise MasklnError(f"--dtype: must be one of {', '.join(GENERATE_DTYPES)}, got {dtype!r}")
    if valid_dtype not in VALID_DTYPES:
        raise MasklnError(
            f"--valid-dtype: must be one of {', '.join(VALID_DTYPES)}, got {valid_dtype!r}"
        )
    if not math.isfinite(offset):
        raise MasklnError(f"--offset: must be a finite number, got {offset}")
    if not (math.isfinite(std) and std >= 0):
        raise MasklnError(f"--std: must be a finite number >= 0, got {std}")
    target = getattr(torch, dtype)
    sample_dtype = torch.float64 if target == torch.float64 else torch.float32
    # x is sampled, possibly poisoned (a copy) and cast (a copy); grad_out sampled and cast.
    per_element = (2 + grad) * (sample_dtype.itemsize + target.itemsize)
    check_memory(math.prod(shape) * per_element, f"--shape {','.join(map(str, shape))}")
    total = math.prod(shape) * target.itemsize * (1 + grad)
    done = 0

    def advance(elements: int) -> None:
        nonlocal done
        done += elements * target.itemsize
        if progress:
            progress(done, total)

    generator = torch.Generator().manual_seed(seed)
    channels = shape[-1]
    valid = padding_mask(shape[:-1], invalid, generator)
    x = sample_normal(shape, generator, sample_dtype, offset, std, advance)
    if poison:
        junk = torch.tensor([math.nan, math.inf, -math.inf], dtype=sample_dtype)
        filler = junk.repeat(math.ceil(x.numel() / 3) if x.numel() else 0)[: x.numel()]
        x = torch.where(valid[..., None], x, filler.reshape(shape))
    x = x.to(target)
    if offset != 0.0 or std != 1.0:
        _check_no_overflow(x, valid if poison else None, f"--offset {offset:g} --std {std:g}")
    tensors = {
        "x": x,
        "valid": valid.to(getattr(torch, valid_dtype)),
        "scale": (1.0 + 0.1 * torch.randn(channels, generator=generator)).to(target),
        "bias": (0.1 * torch.randn(channels, generator=generator)).to(target),
    }
    if norm != "layer":  # drawn all the same: every other tensor is the LayerNorm file's
        del tensors["bias"]
    if grad:
        tensors["grad_out"] = sample_normal(shape, generator, sample_dtype, advance=advance).to(
            target
        )
    return tensors


def _check_no_overflow(x: torch.Tensor, valid: torch.Tensor | None, options: str) -> None:
    """x, cast to its dtype, is finite (on the valid rows, when padding holds poison)."""
    import torch

    values = x if valid is None else torch.where(valid[..., None], x, 0)
    if not bool(values.isfinite().all()):
        largest = torch.finfo(x.dtype).max
        raise MasklnError(f"{options}: x overflows {dtype_name(x.dtype)} (largest {largest:g})")
