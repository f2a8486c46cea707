"""Row masks from files: ``--valid FILE[:KEY]``, and any tensor read as a bool mask.

A mask is bool, or an integer or floating tensor holding only 0 and 1, 1 meaning valid (a
transformers ``attention_mask`` is int64 0/1): the op's one mask rule, which the function and
``MaskedLayerNorm`` apply too. Anything else is refused with a message naming the file and key.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from maskln_cli.errors import MasklnError
from maskln_cli.files.tensorfile import STDIO, open_tensor_file

if TYPE_CHECKING:
    import torch


DEFAULT_KEY = "valid"


def parse_mask_spec(spec: str) -> tuple[str, str]:
    """``FILE[:KEY]`` -> ``(FILE, KEY)``; KEY defaults to 'valid'. A FILE that exists as given
    is taken whole, so a path holding ':' still works.

    Example:
        >>> parse_mask_spec("acts.safetensors:attention_mask"), parse_mask_spec("m.safetensors")
        (('acts.safetensors', 'attention_mask'), ('m.safetensors', 'valid'))
    """
    if spec == STDIO or os.path.exists(spec) or ":" not in spec:
        return spec, DEFAULT_KEY
    path, key = spec.rsplit(":", 1)
    if not path or not key:
        raise MasklnError(f"--valid: expected FILE or FILE:KEY, got {spec!r}")
    return path, key


@dataclass
class RowMask:
    """Which rows to compare: ``keep`` holds one bool per row (flattened ``shape``)."""

    source: str
    shape: tuple[int, ...]
    keep: torch.Tensor

    @property
    def rows(self) -> int:
        return math.prod(self.shape)

    @property
    def left_out(self) -> int:
        return self.rows - int(self.keep.sum())

    def applies_to(self, shape: Sequence[int]) -> bool:
        """Whether a tensor of ``shape`` has this mask's rows: shape is ``[*mask.shape, C]``."""
        return len(shape) == len(self.shape) + 1 and tuple(shape[:-1]) == self.shape


@contextlib.contextmanager
def open_row_mask(spec: str) -> Iterator[RowMask]:
    """The mask ``FILE[:KEY]`` names: bool, or numbers holding only 0 and 1.

    Example:
        >>> with open_row_mask("sample_data/worked_example.safetensors") as mask:
        ...     mask.source, mask.shape, mask.left_out
        ('sample_data/worked_example.safetensors:valid', (1, 2), 1)
    """
    path, key = parse_mask_spec(spec)
    if path != spec and path != STDIO and not os.path.exists(path):
        # Neither the path as given nor its part before the last ':' exists: name both
        # readings, not just the part, which the user never typed as such.
        raise MasklnError(
            f"--valid: no such file: {spec!r} (nor {path!r}, reading {key!r} as the KEY)"
        )
    with contextlib.ExitStack() as stack:
        try:  # the option is named, so that "no tensor 'valid'" says where 'valid' came from
            file = stack.enter_context(open_tensor_file(path))
            mask = file.tensor(key)
            if mask.dim() == 0:
                raise MasklnError(
                    f"{file.name}: tensor {key!r} is 0-d; a mask has one entry per row"
                )
            keep = as_mask(mask, file.name, key, tuple(mask.shape)).reshape(-1)
        except MasklnError as error:
            raise MasklnError(f"--valid: {error}") from None
        yield RowMask(f"{file.name}:{key}", tuple(mask.shape), keep)


def as_mask(valid: torch.Tensor, source: str, key: str, leading: tuple[int, ...]) -> torch.Tensor:
    """valid as bool, by the op's one mask rule (:func:`maskln_cli.op.checks.as_valid_mask`):
    bool as is; integer or floating only if it holds nothing but 0 and 1."""
    from maskln_cli.op.checks import as_valid_mask

    where = f"{source}: tensor {key!r}"
    if tuple(valid.shape) != leading:
        raise MasklnError(
            f"{where} has shape {list(valid.shape)}; expected x's leading shape {list(leading)}"
        )
    try:
        return as_valid_mask(valid, where)
    except (TypeError, ValueError) as error:
        raise MasklnError(str(error)) from None
