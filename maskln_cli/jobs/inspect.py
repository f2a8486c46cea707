"""What a safetensors file holds: per-tensor summaries computed chunk by chunk (``maskln inspect``).

Tensors stay memory-mapped and are summarized a chunk of elements at a time, so a 10 GB file is
never loaded at once. With ``keys_only`` only the header is read (names, dtypes, shapes, sizes).
The result is plain data: :mod:`maskln_cli.cli.report` renders it.

The statistics are computed with numpy on the file's bytes, without torch: importing torch
takes about 1.8 s, several times what summarizing a 418 MiB checkpoint takes. bfloat16 is read
through its bits (a float32's upper half, exact); only float8 tensors are decoded by torch,
which is then imported.

Speed: a chunk without NaN or inf (nearly every chunk of a checkpoint) is summarized in its own
dtype (float16 and bfloat16 in float32), in a few fast passes (min, max, sum, deviations from
the sum's mean, their squares' sum); see :func:`_finite_moments` for why that is still
accurate. Chunks holding NaN or inf take a slower float64 path that counts them. Chunks run on
a few threads, each chunk whole on one of them (numpy releases the GIL in its loops); their
results merge in file order, so they do not depend on the number of threads.
"""

from __future__ import annotations

import fnmatch
import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np

from maskln_cli.compare.data import has_values, plain_data
from maskln_cli.files.checkpoint import Tensors, open_checkpoint
from maskln_cli.files.problem import FileNorm, file_norm

T = TypeVar("T")
R = TypeVar("R")

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
    norm: FileNorm | None = None
    """The norm the file is for (--norm, its checkpoint's config.json, its metadata 'norm')."""

    def to_dict(self) -> dict[str, object]:
        def entry(tensor: TensorSummary) -> dict[str, object]:
            full = tensor.to_dict()
            return {k: full[k] for k in HEADER_FIELDS} if self.keys_only else full

        return {
            "file": self.file,
            "metadata": dict(self.metadata),
            "norm": plain_data(self.norm) if self.norm is not None else None,
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
    norm: str | None = None,
) -> FileSummary:
    """Summarize the tensors of ``path`` (``-`` for stdin; a checkpoint folder or shard index
    too) whose keys match ``patterns`` (all without any); with ``keys_only``, from the header.
    ``norm`` (``layer`` or ``rms``, --norm) is the norm it is for, else what its checkpoint's
    config.json or its metadata names (:func:`~maskln_cli.files.problem.file_norm`).

    Example:
        >>> summary = summarize_file("sample_data/worked_example.safetensors")
        >>> [(t.name, t.shape, t.min, t.max, t.true) for t in summary.tensors]
        [('bias', [2], 0.5, 1.0, None), ('scale', [2], -1.0, 2.0, None), \
('x', [1, 2, 2], -99.0, 99.0, None), ('valid', [1, 2], None, None, 1)]
    """
    with open_checkpoint(path, torch_tensors=False) as file:
        found = file_norm(path, file.metadata, file.name, norm)
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

            _add_all_statistics(file, summaries, advance)
        return FileSummary(
            file=file.name,
            metadata=file.metadata,
            tensors=summaries,
            keys_total=len(file.keys()),
            keys_only=keys_only,
            patterns=tuple(patterns),
            norm=found,
        )


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


SMALL_ELEMENTS = 1024
"""Floating tensors of at most this many elements are summarized many at a time."""
SMALL_BATCH = 4096
"""How many such tensors at a time, at most."""
MAX_WORKERS = 8
"""Threads summarizing chunks, at most (one per CPU this process may run on)."""

_STORED = {"float64": "<f8", "float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}
_STORED |= {f"int{bits}": f"<i{bits // 8}" for bits in (8, 16, 32, 64)}
_STORED |= {f"uint{bits}": f"<u{bits // 8}" for bits in (8, 16, 32, 64)}
_STORED |= {"bool": "u1"}
"""numpy's dtype for each dtype's stored elements (bfloat16 as its bits; float8 are bytes)."""


def _kind(dtype: str) -> str | None:
    """``"float"``, ``"integer"`` or ``"bool"``: how a tensor of ``dtype`` is summarized; None
    for those without statistics (complex, F4, F6)."""
    if dtype == "bool":
        return "bool"
    if dtype in ("float64", "float32", "float16", "bfloat16"):
        return "float"
    if dtype.startswith("float8_"):  # decoded by torch, if this torch has the dtype
        return "float" if has_values(dtype) else None
    return "integer" if dtype in _STORED else None


def _add_all_statistics(
    file: Tensors, summaries: list[TensorSummary], advance: Callable[[int], None]
) -> None:
    """Fill in every summary's statistics; ``advance`` is told the bytes of each chunk done."""
    floating: list[TensorSummary] = []
    small: dict[tuple[str, int], list[TensorSummary]] = {}  # by dtype and size
    for summary in summaries:
        kind = _kind(summary.dtype)
        if kind is None:
            advance(summary.bytes)
        elif kind == "float" and 0 < summary.numel <= SMALL_ELEMENTS:
            small.setdefault((summary.dtype, summary.numel), []).append(summary)
        elif kind == "float":
            floating.append(summary)
        elif kind == "bool":
            chunks = _chunks(_stored(file, summary), advance)
            summary.true = sum(int(np.count_nonzero(chunk)) for chunk in chunks)
        else:
            _add_integer_statistics(summary, _stored(file, summary), advance)
    _add_float_statistics(file, floating, advance)
    for group in small.values():
        for start in range(0, len(group), SMALL_BATCH):
            _add_small_statistics(file, group[start : start + SMALL_BATCH], advance)


def _stored(file: Tensors, summary: TensorSummary) -> np.ndarray:
    """The tensor's elements as stored, 1-d and memory-mapped: numbers numpy reads, bfloat16
    as its bits, float8 as bytes."""
    return file.mapped(summary.name).view(_STORED.get(summary.dtype, "u1"))


def _floats(stored: np.ndarray, dtype: str) -> np.ndarray:
    """float32 or float64 values of stored elements of the floating ``dtype``, exactly."""
    if dtype in ("float32", "float64"):
        return stored
    if dtype == "float16":
        return stored.astype(np.float32)
    if dtype == "bfloat16":  # the upper half of a float32
        return (stored.astype(np.uint32) << 16).view(np.float32)
    import torch  # float8: numpy has no such dtypes

    from maskln_cli.files.tensorfile import torch_dtype

    return torch.from_numpy(stored).view(torch_dtype(dtype)).float().numpy()


def _add_float_statistics(
    file: Tensors, summaries: list[TensorSummary], advance: Callable[[int], None]
) -> None:
    """Fill in the statistics of floating tensors, a chunk at a time, their chunks summarized
    on a few threads and merged in order."""

    def chunks() -> Iterator[tuple[int, str, np.ndarray]]:
        for index, summary in enumerate(summaries):
            stored = _stored(file, summary)
            for start in range(0, stored.size, CHUNK_ELEMENTS):
                yield index, summary.dtype, stored[start : start + CHUNK_ELEMENTS]

    def summarize(job: tuple[int, str, np.ndarray]) -> _Chunk:
        _, dtype, stored = job
        return _chunk_moments(_floats(stored, dtype))

    moments = [_Moments() for _ in summaries]
    for (index, _, stored), chunk in _in_order(summarize, chunks(), _workers()):
        moments[index].merge(chunk)
        advance(stored.nbytes)
    for summary, summary_moments in zip(summaries, moments, strict=True):
        summary_moments.fill(summary)


def _add_small_statistics(
    file: Tensors, summaries: list[TensorSummary], advance: Callable[[int], None]
) -> None:
    """Statistics of small floating tensors of one dtype and size, many at a time: the
    operations of :func:`_finite_moments`, row by row (for 10,000 tiny tensors, one call
    each was most of what ``inspect`` spent). A tensor with NaN or inf, or whose sums
    overflow, is summarized alone."""
    values = _floats(np.stack([_stored(file, s) for s in summaries]), summaries[0].dtype)
    count = values.shape[1]
    with np.errstate(all="ignore"):
        low, high = values.min(axis=1), values.max(axis=1)
        totals = values.sum(axis=1)
        shifts = (totals.astype(np.float64) / count).astype(values.dtype)
        deviations = values - shifts[:, None]
        deviation_sums = deviations.sum(axis=1).tolist()
        squares = np.square(deviations, out=deviations).sum(axis=1).tolist()
    rows = zip(values, summaries, low.tolist(), high.tolist(), totals.tolist(), shifts.tolist(),
               deviation_sums, squares, strict=True)  # fmt: skip
    for row, summary, row_low, row_high, total, shift, deviation_sum, row_squares in rows:
        if row_low == 0 or row_high == 0:  # which of -0.0 and 0.0: as for the tensor alone
            row_low, row_high = float(row.min()), float(row.max())
        moments = _Moments()
        finite = all(map(math.isfinite, (row_low, row_high, total, row_squares)))
        if finite and not _too_small(row_low, row_high, values.dtype.itemsize):
            moments.merge(_deviation_moments(count, row_low, row_high, shift, deviation_sum,
                                             row_squares))  # fmt: skip
        else:
            moments.merge(_chunk_moments(row))
        moments.fill(summary)
        advance(summary.bytes)


def _add_integer_statistics(
    summary: TensorSummary, elements: np.ndarray, advance: Callable[[int], None]
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
    for chunk in _chunks(elements, advance):
        if chunk.size == 0:
            continue
        chunk_low, chunk_high = int(chunk.min()), int(chunk.max())
        low = chunk_low if low is None else min(low, chunk_low)
        high = chunk_high if high is None else max(high, chunk_high)
        if reference is None:
            reference = int(chunk[0])
        count += chunk.size
        total += _exact_sum(chunk)
        if exact_deviations and low - reference >= -(2**63) and high - reference < 2**63:
            # int64 arithmetic wraps modulo 2**64: within int64's range, the result is exact
            bits = chunk.view(np.int64) if chunk.dtype == np.uint64 else chunk.astype(np.int64)
            deviations = bits - np.int64(_wrapped(reference))
            deviation_total += _exact_sum(deviations)
            square_total += float(np.square(deviations.astype(np.float64)).sum())
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
        for chunk in _chunks(elements, None):
            moments.merge(_scaled_moments(chunk.astype(np.float64)))
        summary.std = moments.result()[1]
    if low >= 0 and high <= 1:  # a 0/1 mask: its count of true
        summary.true = total
    return summary


def _wrapped(value: int) -> int:
    """``value`` modulo 2**64, as a signed 64-bit integer."""
    return (value + 2**63) % 2**64 - 2**63


def _exact_sum(chunk: np.ndarray) -> int:
    """The exact sum of an integer chunk (at most 2**22 values): 32-bit halves summed apart
    cannot overflow."""
    if chunk.dtype.itemsize < 8:
        return int(chunk.sum(dtype=np.int64))
    high = chunk >> 32  # arithmetic for int64: chunk = high * 2**32 + low, 0 <= low < 2**32
    low = chunk & 0xFFFFFFFF
    return int(high.sum()) * 2**32 + int(low.sum())


def _chunks(flat: np.ndarray, advance: Callable[[int], None] | None) -> Iterator[np.ndarray]:
    for start in range(0, flat.size, CHUNK_ELEMENTS):
        chunk = flat[start : start + CHUNK_ELEMENTS]
        yield chunk
        if advance:
            advance(chunk.nbytes)


def _workers() -> int:
    """Threads for summarizing chunks: one per CPU this process may run on."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cpus))


def _in_order(work: Callable[[T], R], items: Iterable[T], workers: int) -> Iterator[tuple[T, R]]:
    """``(item, work(item))`` for each item, in order, computed on ``workers`` threads with at
    most twice that many items in flight. On an error or an interruption (Ctrl-C), the items
    not yet started are dropped and those running are waited for.

    Example:
        >>> [result for _, result in _in_order(lambda n: n * n, range(5), 2)]
        [0, 1, 4, 9, 16]
    """
    if workers <= 1:
        for item in items:
            yield item, work(item)
        return
    pending: deque[tuple[T, Future[R]]] = deque()
    with ThreadPoolExecutor(workers, thread_name_prefix="maskln-inspect") as pool:
        try:
            for item in items:
                pending.append((item, pool.submit(work, item)))
                if len(pending) >= 2 * workers:
                    item, future = pending.popleft()
                    yield item, future.result()
            while pending:
                item, future = pending.popleft()
                yield item, future.result()
        finally:
            for _, future in pending:
                future.cancel()


class _Chunk(NamedTuple):
    """A chunk's count of finite values, their min, max, mean and sum of squared deviations
    (m2), the mean in units of 2**exponent and m2 in units of 4**exponent, and its count of
    NaN and of inf."""

    count: int
    mean: float
    m2: float
    low: float
    high: float
    exponent: int
    nan: int = 0
    inf: int = 0


EMPTY_CHUNK = _Chunk(0, 0.0, 0.0, math.inf, -math.inf, 0)


def _chunk_moments(values: np.ndarray) -> _Chunk:
    """The moments of a chunk of float32 or float64 values: in their own dtype when all are
    finite and their sums cannot overflow, else in float64, counting NaN and inf."""
    with np.errstate(all="ignore"):  # overflows and NaN are detected, not warned about
        fast = _finite_moments(values)
        if fast is not None:
            return fast
        wide = values.astype(np.float64)
        finite = wide[np.isfinite(wide)]
        nan = int(np.count_nonzero(np.isnan(wide)))
        return _scaled_moments(finite)._replace(nan=nan, inf=wide.size - nan - finite.size)


def _finite_moments(values: np.ndarray) -> _Chunk | None:
    """The moments of float32 or float64 ``values``, if all are finite and their sums cannot
    overflow; else None.

    They are computed in the values' own dtype, which is as accurate as float64 arithmetic
    here: numpy sums pairwise (error about 1e-7 of the sum of magnitudes, in float32), the
    deviations are taken from the chunk's mean rounded to the dtype, so they are exact
    (Sterbenz) even under a large common offset, and what that rounding shifts is corrected
    with their sum (the shifted two-pass formula). Chunk results merge in float64.
    """
    count = values.size
    if count == 0:
        return EMPTY_CHUNK
    low, high = float(values.min()), float(values.max())
    total = float(values.sum())
    # NaN reaches min, max and the sum; inf reaches min or max; a sum that overflows
    # (values near the dtype's limit) is not finite either: all take the float64 path.
    if not (math.isfinite(low) and math.isfinite(high) and math.isfinite(total)):
        return None
    if _too_small(low, high, values.dtype.itemsize):
        return None  # the squares of the deviations would underflow: the scaled path
    shift = values.dtype.type(total / count)
    deviations = values - shift
    deviation_sum = float(deviations.sum())
    squares = float(np.square(deviations, out=deviations).sum())
    if not math.isfinite(squares):  # squares overflowed: the scaled float64 path
        return None
    return _deviation_moments(count, low, high, float(shift), deviation_sum, squares)


_SMALLEST_UNSCALED = {4: -40, 8: -459}
"""By itemsize, the least exponent of a chunk's largest magnitude that :func:`_finite_moments`
summarizes unscaled: below it, a deviation of one unit in the last place squares to less than
the smallest normal number (float32: (2**(-41-23))**2 < 2**-126) and the std loses its digits
(values of 1e-25 had a std of 0)."""


def _too_small(low: float, high: float, itemsize: int) -> bool:
    """Whether values from ``low`` to ``high`` are too small to summarize unscaled."""
    return math.frexp(max(abs(low), abs(high)))[1] < _SMALLEST_UNSCALED[itemsize]


def _deviation_moments(
    count: int, low: float, high: float, shift: float, deviation_sum: float, squares: float
) -> _Chunk:
    """The moments of ``count`` finite values from their min and max, and the sum of their
    deviations from ``shift`` and of their squares."""
    mean = shift + deviation_sum / count
    m2 = max(0.0, squares - deviation_sum * deviation_sum / count)
    # In units of the chunk's magnitude: chunks near float64's limit merge too.
    exponent = math.frexp(max(abs(low), abs(high)))[1]
    return _Chunk(count, math.ldexp(mean, -exponent), math.ldexp(m2, -2 * exponent), low, high,
                  exponent)  # fmt: skip


def _scaled_moments(values: np.ndarray) -> _Chunk:
    """The moments of finite float64 ``values`` of any magnitude, scaled by a power of two so
    that nothing overflows."""
    count = values.size
    if count == 0:
        return EMPTY_CHUNK
    low, high = float(values.min()), float(values.max())
    exponent = math.frexp(max(abs(low), abs(high)))[1]
    scaled = np.ldexp(values, -exponent)
    shift = float(scaled.mean())
    deviations = scaled - shift
    deviation_sum = float(deviations.sum())
    # The shifted two-pass formula, as in _deviation_moments: constant values have m2 0.
    m2 = max(0.0, float(np.square(deviations).sum()) - deviation_sum * deviation_sum / count)
    return _Chunk(count, shift + deviation_sum / count, m2, low, high, exponent)


class _Moments:
    """Count, min, max, mean and sum of squared deviations, merged over chunks (Chan et al.),
    and the counts of NaN and inf.

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
        self.nan = 0
        self.inf = 0

    def result(self) -> tuple[float, float]:
        """``(mean, std)`` (population), finite for finite values of any magnitude."""
        mean = math.ldexp(self.mean, self.exponent)
        return mean, math.ldexp(math.sqrt(self.m2 / self.count), self.exponent)

    def fill(self, summary: TensorSummary) -> None:
        """Set ``summary``'s statistics: NaN and inf counts, and min, max, mean and std of the
        finite values if there are any."""
        summary.nan, summary.inf = self.nan, self.inf
        if self.count:
            summary.min, summary.max = self.min, self.max
            summary.mean, summary.std = self.result()

    def merge(self, chunk: _Chunk) -> None:
        """Merge a chunk's moments."""
        self.nan += chunk.nan
        self.inf += chunk.inf
        if not chunk.count:
            return
        # The first chunk sets the unit: tiny values keep their digits.
        common = max(self.exponent, chunk.exponent) if self.count else chunk.exponent
        # to the common unit (exact but for tiny values, which then do not matter)
        self.mean = math.ldexp(self.mean, self.exponent - common)
        self.m2 = math.ldexp(self.m2, 2 * (self.exponent - common))
        mean = math.ldexp(chunk.mean, chunk.exponent - common)
        m2 = math.ldexp(chunk.m2, 2 * (chunk.exponent - common))
        self.exponent = common
        total = self.count + chunk.count
        delta = mean - self.mean
        self.mean += delta * chunk.count / total
        self.m2 += m2 + delta * delta * self.count * chunk.count / total
        self.count = total
        self.min = min(self.min, chunk.low)
        self.max = max(self.max, chunk.high)
