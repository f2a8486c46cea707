"""What a safetensors file holds: per-tensor summaries computed chunk by chunk (``maskln inspect``).

Tensors stay memory-mapped and are summarized a chunk of elements at a time, so a 10 GB file is
never loaded at once. With ``keys_only`` only the header is read (names, dtypes, shapes, sizes):
instant on any size, and torch is not imported. The result is plain data:
:mod:`maskln_cli.report` renders it.

Speed: a chunk without NaN or inf (nearly every chunk of a checkpoint) is summarized in its own
dtype, in four fast passes (min and max, sum, deviations from the sum's mean, their squares'
sum), at about the speed of reading it; see :meth:`_Moments.add_finite` for why that is still
accurate. Chunks holding NaN or inf take a slower float64 path that counts them. The passes run
on one thread: they stream memory, so a second thread gains little (0.21 s instead of 0.36 s
on a 418 MiB checkpoint, 2 idle cores), and when other processes keep the cores busy, every
pass waits for the other thread to be scheduled (there: 2 to 5 s instead of 0.5 s).
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from maskln_cli.checkpoint import Tensors, open_checkpoint
from maskln_cli.compare import converts_to_float64, has_values, plain_data
from maskln_cli.tensorfile import torch_dtype

if TYPE_CHECKING:
    import torch

CHUNK_ELEMENTS = 1 << 20
"""Elements summarized at a time: small enough that a chunk's passes run in the CPU's cache."""
HEADER_FIELDS = ("name", "dtype", "shape", "numel", "bytes")
"""What ``keys_only`` summaries hold (``maskln inspect --keys``)."""

Progress = Callable[[int, int], None]
"""Called with (bytes summarized, total bytes)."""


@dataclass
class TensorSummary:
    """One tensor's header entry and statistics.

    ``min``, ``max``, ``mean`` and ``std`` (population) are over finite values and are ``None``
    when there are none or for bool tensors; ``nan`` and ``inf`` count non-finite elements of
    floating tensors; ``true`` counts the true elements of bool tensors, and the ones of integer
    tensors holding only 0 and 1 (masks saved as integers).
    """

    name: str
    dtype: str
    shape: list[int]
    numel: int
    bytes: int
    min: float | int | None = None
    max: float | int | None = None
    mean: float | None = None
    std: float | None = None
    nan: int | None = None
    inf: int | None = None
    true: int | None = None

    def to_dict(self) -> dict[str, object]:
        return plain_data(self)  # type: ignore[return-value]


@dataclass
class FileSummary:
    """A file's metadata and the summaries of its tensors, in file order."""

    file: str
    metadata: dict[str, str]
    tensors: list[TensorSummary]
    keys_total: int = 0
    """Keys in the file (``tensors`` may hold fewer: those ``--match`` selected)."""
    keys_only: bool = False
    patterns: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        def entry(tensor: TensorSummary) -> dict[str, object]:
            full = tensor.to_dict()
            return {k: full[k] for k in HEADER_FIELDS} if self.keys_only else full

        return {
            "file": self.file,
            "metadata": dict(self.metadata),
            "tensors": [entry(t) for t in self.tensors],
        }


def matching_keys(keys: Sequence[str], patterns: Sequence[str]) -> list[str]:
    """The keys matching any of the glob ``patterns``, case-insensitively (all without any).

    Example:
        >>> matching_keys(["emb.LayerNorm.weight", "emb.dense.weight"], ["*layernorm*"])
        ['emb.LayerNorm.weight']
    """
    if not patterns:
        return list(keys)
    lowered = [p.lower() for p in patterns]
    return [k for k in keys if any(fnmatch.fnmatchcase(k.lower(), p) for p in lowered)]


def summarize_file(
    path: str,
    patterns: Sequence[str] = (),
    progress: Progress | None = None,
    keys_only: bool = False,
) -> FileSummary:
    """Summarize the tensors of ``path`` (``-`` for stdin; a checkpoint folder or shard index
    too) whose keys match ``patterns`` (all without any); with ``keys_only``, from the header.

    Example:
        >>> summary = summarize_file("sample_data/worked_example.safetensors")
        >>> [(t.name, t.shape, t.min, t.max, t.true) for t in summary.tensors]
        [('bias', [2], 0.5, 1.0, None), ('scale', [2], -1.0, 2.0, None), \
('x', [1, 2, 2], -99.0, 99.0, None), ('valid', [1, 2], None, None, 1)]
    """
    with open_checkpoint(path, header_only=keys_only) as file:
        keys = matching_keys(file.keys(), patterns)
        summaries = [header_summary(file, key) for key in keys]
        if not keys_only:
            total = sum(s.bytes for s in summaries)
            done = 0

            def advance(nbytes: int) -> None:
                nonlocal done
                done += nbytes
                if progress:
                    progress(done, total)

            with _one_thread():
                small: dict[tuple[str, int], list[TensorSummary]] = {}  # by dtype and size
                for summary in summaries:
                    if not has_values(summary.dtype):  # complex, F4, F6_E2M3...: no statistics
                        advance(summary.bytes)
                    elif 0 < summary.numel <= SMALL_ELEMENTS and _floating(summary.dtype):
                        small.setdefault((summary.dtype, summary.numel), []).append(summary)
                    else:
                        add_statistics(summary, file.tensor(summary.name), advance)
                for group in small.values():
                    for start in range(0, len(group), SMALL_BATCH):
                        _add_small_statistics(file, group[start : start + SMALL_BATCH], advance)
        return FileSummary(
            file=file.name,
            metadata=file.metadata,
            tensors=summaries,
            keys_total=len(file.keys()),
            keys_only=keys_only,
            patterns=tuple(patterns),
        )


SMALL_ELEMENTS = 1024
"""Floating tensors of at most this many elements are summarized many at a time."""
SMALL_BATCH = 4096
"""How many such tensors at a time, at most."""


def _floating(dtype: str) -> bool:
    torch_type = torch_dtype(dtype)
    return torch_type is not None and torch_type.is_floating_point


def _add_small_statistics(
    file: Tensors, summaries: list[TensorSummary], advance: Callable[[int], None]
) -> None:
    """Statistics of small floating tensors of one dtype and size, many at a time: the
    operations of :meth:`_Moments.add_finite`, row by row (for 10,000 tiny tensors, one call
    each was most of what ``inspect`` spent). A tensor with NaN or inf, or whose sums
    overflow, is summarized alone by :func:`add_statistics`."""
    import torch

    stored = file.stacked([s.name for s in summaries])
    values = stored if stored.dtype in (torch.float32, torch.float64) else stored.float()
    count = values.shape[1]
    low, high = torch.aminmax(values, dim=1)
    totals = values.sum(dim=1).tolist()
    shifts = values.new_tensor([total / count for total in totals])
    deviations = values - shifts[:, None]
    deviation_sums = deviations.sum(dim=1).tolist()
    squares = deviations.square_().sum(dim=1).tolist()
    rows = zip(stored, values, summaries, low.tolist(), high.tolist(), totals, shifts.tolist(),
               deviation_sums, squares, strict=True)  # fmt: skip
    for tensor, row, summary, row_low, row_high, total, shift, deviation_sum, row_squares in rows:
        if row_low == 0 or row_high == 0:  # which of -0.0 and 0.0: as the tensor's own aminmax
            row_low, row_high = (float(v) for v in torch.aminmax(row))
        moments = _Moments()
        finite = all(map(math.isfinite, (row_low, row_high, total)))
        if not (finite and moments.add_deviations(count, row_low, row_high, shift,
                                                  deviation_sum, row_squares)):  # fmt: skip
            add_statistics(summary, tensor, advance)
            continue
        summary.nan = summary.inf = 0
        summary.min, summary.max = moments.min, moments.max
        summary.mean, summary.std = moments.result()
        advance(summary.bytes)


def _one_thread() -> contextlib.AbstractContextManager[None]:
    """torch on one thread in this thread for the block, then as it was; other threads keep
    theirs (torch.set_num_threads would set the count of every thread started meanwhile)."""
    from maskln_cli.threads import one_thread

    return one_thread()


def header_summary(file: Tensors, key: str) -> TensorSummary:
    """What the header says of ``key``: dtype, shape and size; no data is read."""
    info = file.info(key)
    return TensorSummary(
        name=key,
        dtype=info.dtype,
        shape=list(info.shape),
        numel=info.numel,
        bytes=file.data_size(key),
    )


def add_statistics(
    summary: TensorSummary, tensor: torch.Tensor, advance: Callable[[int], None] | None = None
) -> TensorSummary:
    """Fill in ``summary``'s statistics from ``tensor``, read a chunk at a time; ``advance`` is
    told the bytes of each chunk done."""
    flat = tensor.reshape(-1)
    if summary.dtype == "bool":
        summary.true = 0
        for chunk in _chunks(flat, advance):
            summary.true += int(chunk.sum())
        return summary
    if not converts_to_float64(flat.dtype):  # complex, float4: no statistics
        if advance:
            advance(summary.bytes)
        return summary
    if not flat.is_floating_point():
        return _add_integer_statistics(summary, flat, advance)
    moments = _Moments()
    nan = inf = 0
    for chunk in _chunks(flat, advance):
        if moments.add_finite(chunk):
            continue
        values = chunk.double()
        nan += int(values.isnan().sum())
        inf += int(values.isinf().sum())
        moments.add(values[values.isfinite()])
    summary.nan, summary.inf = nan, inf
    if moments.count:
        summary.min, summary.max = moments.min, moments.max
        summary.mean, summary.std = moments.result()
    return summary


def _add_integer_statistics(
    summary: TensorSummary, flat: torch.Tensor, advance: Callable[[int], None] | None
) -> TensorSummary:
    """Integer statistics, exact where float64 would round: min and max as Python ints, the
    mean from an exact sum, the std from deviations from the first value, taken in integers.

    int64 values above 2**53 are not all float64 numbers: [2**62, 2**62 + 1] as float64 has a
    std of 0. The sum is exact through 32-bit halves (no int64 overflow in a chunk), and the
    deviations from a fixed reference are exact in int64 unless the values span 2**63 or more,
    where float64's relative precision is enough for the spread.
    """
    count = 0
    total = 0  # exact
    deviation_total = 0  # exact, from the reference
    square_total = 0.0  # of the deviations, in float64
    low = high = reference = None
    exact_deviations = True
    for chunk in _chunks(flat, advance):
        if chunk.numel() == 0:
            continue
        bits = _Int64Bits(chunk)
        chunk_low, chunk_high = bits.extremes()
        low = chunk_low if low is None else min(low, chunk_low)
        high = chunk_high if high is None else max(high, chunk_high)
        if reference is None:
            reference = bits.value(0)
        count += chunk.numel()
        total += bits.exact_sum()
        if exact_deviations and low - reference >= -(2**63) and high - reference < 2**63:
            # int64 arithmetic wraps modulo 2**64: within int64's range, the result is exact
            deviations = bits.bits - _wrapped(reference)
            deviation_total += _Int64Bits(deviations).exact_sum()
            square_total += float(deviations.double().square().sum())
        else:
            exact_deviations = False
    if count == 0 or low is None or high is None or reference is None:
        return summary
    summary.min, summary.max = low, high
    summary.mean = total / count  # Python rounds the exact quotient once
    if exact_deviations:
        m2 = max(0.0, square_total - deviation_total * deviation_total / count)
        summary.std = math.sqrt(m2 / count)
    else:
        moments = _Moments()
        for chunk in _chunks(flat, None):
            moments.add(_Int64Bits(chunk).as_float64())
        summary.std = moments.result()[1]
    if low >= 0 and high <= 1:  # a 0/1 mask: its count of true
        summary.true = total
    return summary


def _wrapped(value: int) -> int:
    """``value`` modulo 2**64, as a signed 64-bit integer."""
    return (value + 2**63) % 2**64 - 2**63


class _Int64Bits:
    """An integer chunk as int64 bits; uint64 values of 2**63 and up read as negative bits,
    and are put right wherever a value is needed (torch barely computes with uint64)."""

    def __init__(self, chunk: torch.Tensor) -> None:
        import torch

        self.unsigned64 = chunk.dtype == torch.uint64
        self.bits = chunk.view(torch.int64) if self.unsigned64 else chunk.long()

    def value(self, index: int) -> int:
        bits = int(self.bits[index])
        return bits + 2**64 if self.unsigned64 and bits < 0 else bits

    def extremes(self) -> tuple[int, int]:
        import torch

        if not self.unsigned64:
            low, high = torch.aminmax(self.bits)
            return int(low), int(high)
        flipped = self.bits ^ -(2**63)  # unsigned order as signed order
        low, high = torch.aminmax(flipped)
        return int(low) + 2**63, int(high) + 2**63

    def exact_sum(self) -> int:
        """The exact sum (at most 2**22 values): 32-bit halves summed apart cannot overflow."""
        high = self.bits >> 32  # arithmetic: bits = high * 2**32 + low, 0 <= low < 2**32
        low = self.bits - (high << 32)
        total = int(high.sum()) * 2**32 + int(low.sum())
        if self.unsigned64:
            total += 2**64 * int((self.bits < 0).sum())
        return total

    def as_float64(self) -> torch.Tensor:
        import torch

        values = self.bits.double()
        return torch.where(self.bits < 0, values + 2.0**64, values) if self.unsigned64 else values


def _chunks(flat: torch.Tensor, advance: Callable[[int], None] | None) -> Iterator[torch.Tensor]:
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        chunk = flat[start : start + CHUNK_ELEMENTS]
        yield chunk
        if advance:
            advance(chunk.numel() * chunk.element_size())


class _Moments:
    """Count, min, max, mean and sum of squared deviations, merged over chunks (Chan et al.).

    mean and m2 are kept in units of 2**exponent (and 4**exponent): chunks of values near
    float64's limit are summarized scaled by a power of two (exact), whose sums and squares
    cannot overflow, and the result is scaled back at the end.
    """

    def __init__(self) -> None:
        self.count = 0
        self.exponent = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.min = math.inf
        self.max = -math.inf

    def result(self) -> tuple[float, float]:
        """``(mean, std)`` (population), finite for finite values of any magnitude."""
        mean = math.ldexp(self.mean, self.exponent)
        return mean, math.ldexp(math.sqrt(self.m2 / self.count), self.exponent)

    def add_finite(self, chunk: torch.Tensor) -> bool:
        """Merge in ``chunk`` if all its values are finite and its sums cannot overflow; else
        add nothing and return False.

        float32 and float64 are summarized in their own dtype (float16, bfloat16 and float8 in
        float32), which is as accurate as float64 arithmetic here: torch sums with cascade
        summation (error about 1e-7 of the sum of magnitudes, in float32), the deviations are
        taken from the chunk's mean rounded to the dtype, so they are exact (Sterbenz) even
        under a large common offset, and what that rounding shifts is corrected with their sum
        (the shifted two-pass formula). Chunk results merge in float64.
        """
        import torch

        values = chunk if chunk.dtype in (torch.float32, torch.float64) else chunk.float()
        count = values.numel()
        if count == 0:
            return True
        low, high = (float(v) for v in torch.aminmax(values))
        total = float(values.sum())
        # NaN reaches min, max and the sum; inf reaches min or max; a sum that overflows
        # (values near the dtype's limit) is not finite either: all take the float64 path.
        if not (math.isfinite(low) and math.isfinite(high) and math.isfinite(total)):
            return False
        shift = values.new_tensor(total / count)
        deviations = values - shift
        deviation_sum = float(deviations.sum())
        squares = float(deviations.square_().sum())
        return self.add_deviations(count, low, high, float(shift), deviation_sum, squares)

    def add_deviations(
        self,
        count: int,
        low: float,
        high: float,
        shift: float,
        deviation_sum: float,
        squares: float,
    ) -> bool:
        """Merge in a chunk of finite values summarized by :meth:`add_finite`: its count,
        min and max, and the sum of its deviations from ``shift`` and of their squares; or
        add nothing and return False if the squares overflowed."""
        if not math.isfinite(squares):  # squares overflowed: the scaled float64 path
            return False
        mean = shift + deviation_sum / count
        m2 = max(0.0, squares - deviation_sum * deviation_sum / count)
        # Merged in units of the chunk's magnitude: chunks near float64's limit merge too.
        exponent = math.frexp(max(abs(low), abs(high)))[1]
        self._merge(count, math.ldexp(mean, -exponent), math.ldexp(m2, -2 * exponent), low, high,
                    exponent)  # fmt: skip
        return True

    def add(self, values: torch.Tensor) -> None:
        """Merge in float64 ``values`` (finite ones) of any magnitude, scaled by a power of two
        so that nothing overflows."""
        import torch

        count = values.numel()
        if count == 0:
            return
        low, high = (float(v) for v in torch.aminmax(values))
        exponent = math.frexp(max(abs(low), abs(high)))[1]
        scaled = torch.ldexp(values, values.new_tensor(float(-exponent)))
        mean = float(scaled.mean())
        m2 = float((scaled - mean).square().sum())
        self._merge(count, mean, m2, low, high, exponent)

    def _merge(
        self, count: int, mean: float, m2: float, low: float, high: float, exponent: int
    ) -> None:
        """Merge a chunk's moments, ``mean`` and ``m2`` in units of 2**exponent (4**...)."""
        common = max(self.exponent, exponent)
        # to the common unit (exact but for tiny values, which then do not matter)
        self.mean = math.ldexp(self.mean, self.exponent - common)
        self.m2 = math.ldexp(self.m2, 2 * (self.exponent - common))
        mean = math.ldexp(mean, exponent - common)
        m2 = math.ldexp(m2, 2 * (exponent - common))
        self.exponent = common
        total = self.count + count
        delta = mean - self.mean
        self.mean += delta * count / total
        self.m2 += m2 + delta * delta * self.count * count / total
        self.count = total
        self.min = min(self.min, low)
        self.max = max(self.max, high)
