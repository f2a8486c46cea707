"""What a safetensors file holds: per-tensor summaries computed chunk by chunk (``maskln inspect``).

Tensors stay memory-mapped and are summarized a chunk of elements at a time, so a 10 GB file is
never loaded at once. The result is plain data: :mod:`maskln_cli.report` renders it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from maskln_cli.compare import converts_to_float64
from maskln_cli.tensorfile import TensorFile, open_tensor_file

if TYPE_CHECKING:
    import torch

CHUNK_ELEMENTS = 1 << 22
"""Elements summarized at a time (a 32 MiB float64 temporary)."""


@dataclass
class TensorSummary:
    """One tensor's header entry and statistics.

    ``min``, ``max``, ``mean`` and ``std`` (population) are over finite values and are ``None``
    when there are none or for bool tensors; ``nan`` and ``inf`` count non-finite elements of
    floating tensors; ``true`` counts the true elements of bool tensors.
    """

    name: str
    dtype: str
    shape: list[int]
    numel: int
    bytes: int
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    std: float | None = None
    nan: int | None = None
    inf: int | None = None
    true: int | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class FileSummary:
    """A file's metadata and the summaries of its tensors, in file order."""

    file: str
    metadata: dict[str, str]
    tensors: list[TensorSummary]

    def to_dict(self) -> dict[str, object]:
        return {
            "file": self.file,
            "metadata": dict(self.metadata),
            "tensors": [t.to_dict() for t in self.tensors],
        }


def summarize_file(path: str) -> FileSummary:
    """Summarize every tensor of the safetensors file at ``path`` (``-`` for stdin).

    Example:
        >>> summary = summarize_file("sample_data/worked_example.safetensors")
        >>> [(t.name, t.shape, t.min, t.max, t.true) for t in summary.tensors]
        [('bias', [2], 0.5, 1.0, None), ('scale', [2], -1.0, 2.0, None), \
('x', [1, 2, 2], -99.0, 99.0, None), ('valid', [1, 2], None, None, 1)]
    """
    with open_tensor_file(path) as file:
        return FileSummary(
            file=file.name,
            metadata=file.metadata,
            tensors=[summarize_tensor(file, key) for key in file],
        )


def summarize_tensor(file: TensorFile, key: str) -> TensorSummary:
    """Summarize one tensor of an open file, reading it a chunk at a time."""
    info = file.info(key)
    tensor = file.tensor(key).reshape(-1)
    summary = TensorSummary(
        name=key,
        dtype=info.dtype,
        shape=list(info.shape),
        numel=info.numel,
        bytes=info.numel * tensor.element_size(),
    )
    if info.dtype == "bool":
        summary.true = sum(int(chunk.sum()) for chunk in _chunks(tensor))
        return summary
    if not converts_to_float64(tensor.dtype):  # complex, float4: no statistics
        return summary
    moments = _Moments()
    nan = inf = 0
    for chunk in _chunks(tensor):
        values = chunk.double()
        finite = values.isfinite()
        if tensor.is_floating_point():
            nan += int(values.isnan().sum())
            inf += int(values.isinf().sum())
            values = values[finite] if not bool(finite.all()) else values
        moments.add(values)
    if tensor.is_floating_point():
        summary.nan, summary.inf = nan, inf
    if moments.count:
        summary.min, summary.max = moments.min, moments.max
        summary.mean, summary.std = moments.mean, math.sqrt(moments.m2 / moments.count)
    return summary


def _chunks(flat: torch.Tensor):
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        yield flat[start : start + CHUNK_ELEMENTS]


class _Moments:
    """Count, min, max, mean and sum of squared deviations, merged over chunks (Chan et al.)."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.min = math.inf
        self.max = -math.inf

    def add(self, values: torch.Tensor) -> None:
        count = values.numel()
        if count == 0:
            return
        mean = float(values.mean())
        m2 = float(((values - mean) ** 2).sum())
        total = self.count + count
        delta = mean - self.mean
        self.mean += delta * count / total
        self.m2 += m2 + delta * delta * self.count * count / total
        self.count = total
        self.min = min(self.min, float(values.min()))
        self.max = max(self.max, float(values.max()))
