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

    from maskln_cli.files.tensorfile import TensorFile


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


def mask_candidates(data: TensorFile, leading: tuple[int, ...]) -> list[str]:
    """Keys of ``data`` holding a bool, or 0/1 integer, tensor of shape ``leading``.

    Example:
        >>> import torch, tempfile
        >>> from safetensors.torch import save_file
        >>> with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        ...     save_file({"x": torch.ones(2, 3, 4), "attention_mask": torch.tensor(
        ...         [[1, 1, 0], [1, 0, 0]])}, f.name)
        ...     with open_tensor_file(f.name) as data:
        ...         mask_candidates(data, (2, 3))
        ['attention_mask']
    """

    found = []
    for key in data:
        info = data.info(key)
        if tuple(info.shape) != tuple(leading):
            continue
        if info.dtype == "bool":
            found.append(key)
        elif info.dtype in ("int64", "int32", "int16", "int8", "uint8"):
            values = data.tensor(key)
            if values.numel() <= 1 << 24 and bool(((values == 0) | (values == 1)).all()):
                found.append(key)
    return sorted(found, key=lambda k: ("mask" not in k.lower(), k))


def valid_key_hint(data: TensorFile, leading: tuple[int, ...]) -> str | None:
    """A note for a file without ``valid`` that holds a mask under another name (an
    ``attention_mask``): the option that reads it. None when it holds none.

    Example:
        >>> import torch, tempfile
        >>> from safetensors.torch import save_file
        >>> with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        ...     mask = torch.ones(2, 3, dtype=torch.long)
        ...     save_file({"x": torch.ones(2, 3, 4), "attention_mask": mask}, f.name)
        ...     with open_tensor_file(f.name) as data:
        ...         print(valid_key_hint(data, (2, 3)).split(": did you mean ")[1])
        `--valid-key attention_mask`?
    """
    found = mask_candidates(data, leading)
    if not found:
        return None
    return (
        f"{data.name}: holds {', '.join(repr(k) for k in found[:3])}, of x's leading shape and"
        f" only 0 and 1: did you mean `--valid-key {found[0]}`?"
    )
