"""Comparing two files key by key (``maskln diff``), and whole in-memory tensors."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from maskln_cli.compare.comparison import Comparison
from maskln_cli.compare.data import (
    INTEGRAL_DTYPES,
    ComparisonReport,
    TensorComparison,
    check_tolerance,
    converts_to_float64,
    has_values,
)
from maskln_cli.compare.integers import IntegerComparison, is_integral
from maskln_cli.errors import MasklnError
from maskln_cli.files.checkpoint import Tensors, open_checkpoint
from maskln_cli.files.tensorfile import (
    TensorFile,
    TensorInfo,
    dtype_name,
)

if TYPE_CHECKING:
    import torch

    from maskln_cli.files.masks import RowMask


ONE_THREAD_BELOW = 1 << 15
"""Tensors of fewer elements are compared on one thread (see :func:`threads_for`)."""


@contextlib.contextmanager
def threads_for(numel: int) -> Iterator[None]:
    """torch on one thread for the block when a tensor of ``numel`` elements is small.

    Threads gain nothing on so little work (torch splits no elementwise kernel below 32,768
    elements), and some reductions start them anyway: with 2 threads on a busy machine a
    ``max(dim=1)`` of shape ``[2, 1]`` took 3.2 ms, against 3 µs on one thread, and diffing
    2,000 tensors of 2 elements that all differ took 25 s. Large tensors keep every thread.

    Example:
        >>> import torch
        >>> before = torch.get_num_threads()
        >>> with threads_for(8):
        ...     inside = torch.get_num_threads()
        >>> inside, torch.get_num_threads() == before
        (1, True)
    """
    if numel >= ONE_THREAD_BELOW:
        yield
        return
    from maskln_cli.op.threads import one_thread

    with one_thread():  # this thread only: not torch.set_num_threads, which sets all threads'
        yield


def compare_tensors(
    name: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    rtol: float | None = None,
    atol: float | None = None,
    keep_rows: torch.Tensor | None = None,
) -> TensorComparison:
    """Compare two whole tensors (which may be memory-mapped), a chunk of rows at a time.

    ``keep_rows`` (bool, one per row of a ``[..., C]`` tensor) leaves the other rows out
    (see :mod:`maskln_cli.compare.rows`).

    Example:
        >>> import torch
        >>> result = compare_tensors("t", torch.tensor([1.0, float("nan")]),
        ...                          torch.tensor([1.0, float("nan")]))
        >>> result.passed, result.nan_mismatched
        (True, 0)
    """
    integers = is_integral(actual.dtype) and is_integral(expected.dtype)
    comparison = (IntegerComparison if integers else Comparison)(
        name,
        list(actual.shape),
        dtype_name(actual.dtype),
        list(expected.shape),
        dtype_name(expected.dtype),
        rtol,
        atol,
    )
    if not (converts_to_float64(actual.dtype) and converts_to_float64(expected.dtype)):
        return comparison.result(_compare_bytes(actual, expected, comparison), compared=False)
    from maskln_cli.compare.rows import count_left_out, leave_out

    if comparison.comparable and comparison.numel:
        length = comparison.row_length
        step = comparison.chunk_rows() * length
        flat_actual, flat_expected = actual.reshape(-1), expected.reshape(-1)
        with threads_for(comparison.numel):
            for start in range(0, comparison.numel, step):
                chunk_actual = flat_actual[start : start + step]
                chunk_expected = flat_expected[start : start + step]
                if keep_rows is None:
                    comparison.update(chunk_actual, chunk_expected)
                    continue
                row = start // length
                keep = keep_rows[row : row + chunk_actual.numel() // length]
                if isinstance(comparison, IntegerComparison):
                    keep = keep.repeat_interleave(length)
                    comparison.update(chunk_actual, chunk_expected, keep=keep)
                else:  # in float64: not every dtype has masked_fill (float8 has not)
                    chunk_actual, chunk_expected = chunk_actual.double(), chunk_expected.double()
                    comparison.update(*leave_out(chunk_actual, chunk_expected, keep))
    outcome = comparison.result()
    if keep_rows is not None and comparison.comparable:
        count_left_out(outcome, int((~keep_rows).sum()))
    return outcome


def _compare_bytes(
    actual: torch.Tensor, expected: torch.Tensor, comparison: Comparison
) -> list[str]:
    """Tensors whose values have no float64 form (complex, float4) must be equal bit for bit."""
    import torch

    dtype = dtype_name(actual.dtype)
    if not comparison.same_shape or actual.dtype != expected.dtype:
        return [f"values not compared: {dtype} vs {dtype_name(expected.dtype)}"]
    as_bytes = (t.contiguous().reshape(-1).view(torch.uint8) for t in (actual, expected))
    if torch.equal(*as_bytes):
        return []
    return [f"{dtype} values differ (compared bit for bit: {dtype} has no float64 form)"]


def missing(
    name: str, side: str, shape: Sequence[int], dtype: str, hint: str = ""
) -> TensorComparison:
    """The outcome for a key present on one side only (``side`` is where it is missing)."""
    present_shape, present_dtype = list(shape), dtype
    actual_side = side == "actual"
    return TensorComparison(
        name=name,
        passed=False,
        problems=[f"missing in {side}{hint}"],
        shape=None if actual_side else present_shape,
        expected_shape=present_shape if actual_side else None,
        dtype=None if actual_side else present_dtype,
        expected_dtype=present_dtype if actual_side else None,
        rtol=math.nan,
        atol=math.nan,
    )


def diff_files(
    actual_path: str,
    expected_path: str,
    keys: Sequence[str] = (),
    rtol: float | None = None,
    atol: float | None = None,
    valid: str | None = None,
    norm: str | None = None,
) -> ComparisonReport:
    """Compare two safetensors files key by key (``-`` for stdin, on one side at most). Either
    side may be a checkpoint instead: a folder holding ``model.safetensors`` or its index, or a
    ``model.safetensors.index.json`` (tensors by name across its shards, memory-mapped).

    With ``keys``, only those keys are compared (each must exist on at least one side). With
    ``valid`` (``FILE[:KEY]``, a mask), tensors of shape ``[*mask.shape, C]`` are compared on
    the mask's valid rows only. Files whose metadata names different norms (``norm``: layer,
    rms) are compared all the same, with a note; with ``norm``, a file naming another is an
    error.

    Example:
        >>> report = diff_files("sample_data/worked_example.safetensors",
        ...                     "sample_data/worked_example.safetensors")
        >>> report.passed, [t.name for t in report.tensors]
        (True, ['bias', 'scale', 'x', 'valid'])
    """
    if [actual_path, expected_path].count("-") > 1:
        raise MasklnError("ACTUAL and EXPECTED cannot both be '-' (stdin)")
    if valid is not None and "-" in (actual_path, expected_path):
        from maskln_cli.files.masks import parse_mask_spec

        if parse_mask_spec(valid)[0] == "-":
            raise MasklnError("--valid cannot read stdin when ACTUAL or EXPECTED does")
    check_tolerance(rtol, "--rtol")
    check_tolerance(atol, "--atol")
    with contextlib.ExitStack() as stack:
        actual = stack.enter_context(open_checkpoint(actual_path))
        expected = stack.enter_context(open_checkpoint(expected_path))
        names = _key_union(actual, expected)
        if keys:
            unknown = [k for k in keys if k not in names]
            if unknown:
                raise MasklnError(
                    f"--key: {unknown[0]!r} is in neither {actual.name} nor {expected.name}"
                )
            names = [k for k in names if k in set(keys)]
        notes = _norm_notes(actual, expected, norm)
        mask = None
        if valid is not None:
            from maskln_cli.compare.rows import row_mask_notes
            from maskln_cli.files.masks import open_row_mask

            mask = stack.enter_context(open_row_mask(valid))
            notes += row_mask_notes(mask, {n: _shape(actual, expected, n) for n in names})
        tensors = list(_compare_keys(actual, expected, names, rtol, atol, mask))
        return ComparisonReport("diff", actual.name, expected.name, tensors, notes)


def _norm_notes(actual: Tensors, expected: Tensors, norm: str | None) -> list[str]:
    """What the two files' metadata says of their norms: a note when they differ; with
    ``norm`` (--norm), a file naming another norm is an error."""
    from maskln_cli.files.problem import named_norm

    named = [(f.name, named_norm(f.metadata, f.name)) for f in (actual, expected)]
    if norm is not None:
        for name, found in named:
            if found is not None and found.name != norm:
                raise MasklnError(
                    f"{name}: metadata 'norm' is {found.name!r} ({found.title}), not --norm {norm}"
                )
        return []
    (first, one), (second, other) = named
    if one is None or other is None or one == other:
        return []
    return [
        f"{first} names {one.title} and {second} {other.title} (metadata 'norm'): compared"
        " all the same"
    ]


def _shape(actual: Tensors, expected: Tensors, name: str) -> tuple[int, ...]:
    return (actual if name in actual else expected).info(name).shape


SMALL_ELEMENTS = 1024
"""Floating tensors of at most this many elements are compared many at a time
(:meth:`Comparison.update_many`)."""
SMALL_BATCH = 4096
"""How many such tensors at a time, at most."""


def _compare_keys(
    actual: Tensors,
    expected: Tensors,
    names: Sequence[str],
    rtol: float | None,
    atol: float | None,
    mask: RowMask | None = None,
) -> list[TensorComparison]:
    outcomes: dict[str, TensorComparison] = {}
    small: dict[tuple[str, tuple[int, ...]], list[str]] = {}  # by dtype and shape
    for name in names:
        if name not in actual:
            info = expected.info(name)
            outcomes[name] = missing(name, "actual", info.shape, info.dtype)
        elif name not in expected:
            info = actual.info(name)
            outcomes[name] = missing(name, "expected", info.shape, info.dtype)
        else:
            info, expected_info = actual.info(name), expected.info(name)
            if not (has_values(info.dtype) and has_values(expected_info.dtype)):
                outcomes[name] = _compare_stored_bytes(actual, expected, info, expected_info)
                continue
            keep = mask.keep if mask and mask.applies_to(info.shape) else None
            same = (info.dtype, info.shape) == (expected_info.dtype, expected_info.shape)
            floating = info.dtype not in INTEGRAL_DTYPES  # integers: IntegerComparison
            # Many at a time from single files (a sharded checkpoint's tensors one by one).
            single = isinstance(actual, TensorFile) and isinstance(expected, TensorFile)
            if same and floating and single and keep is None and 0 < info.numel <= SMALL_ELEMENTS:
                small.setdefault((info.dtype, info.shape), []).append(name)
                continue
            outcomes[name] = compare_tensors(
                name, actual.tensor(name), expected.tensor(name), rtol, atol, keep
            )
    for (dtype, shape), group in small.items():
        for start in range(0, len(group), SMALL_BATCH):
            batch = group[start : start + SMALL_BATCH]
            outcomes.update(_compare_small(actual, expected, batch, dtype, shape, rtol, atol))
    return [outcomes[name] for name in names]


def _compare_small(
    actual: TensorFile,
    expected: TensorFile,
    names: list[str],
    dtype: str,
    shape: tuple[int, ...],
    rtol: float | None,
    atol: float | None,
) -> dict[str, TensorComparison]:
    """Tensors of one dtype and shape on both sides, small: compared many at a time, those
    not all finite and within tolerance one by one."""

    actuals, expecteds = actual.stacked(names), expected.stacked(names)
    comparisons = [Comparison(name, shape, dtype, shape, dtype, rtol, atol) for name in names]
    with threads_for(actuals.numel()):
        fed = Comparison.update_many(comparisons, actuals, expecteds)
    return {
        name: comparison.result()
        if done
        else compare_tensors(name, a.reshape(shape), e.reshape(shape), rtol, atol)
        for name, comparison, done, a, e in zip(
            names, comparisons, fed, actuals, expecteds, strict=True
        )
    }


COMPARED_BYTES = 1 << 24
"""Bytes of a tensor without values read from each file at a time."""


def _compare_stored_bytes(
    actual: Tensors, expected: Tensors, info: TensorInfo, expected_info: TensorInfo
) -> TensorComparison:
    """A tensor whose values maskln cannot read (complex, F4, F6): its shape and dtype as the
    headers say, and its data compared bit for bit, as stored."""
    name, dtype = info.name, info.dtype
    comparison = Comparison(
        name, info.shape, dtype, expected_info.shape, expected_info.dtype, 0.0, 0.0
    )
    problems = []
    if dtype != expected_info.dtype:
        problems.append(f"values not compared: {dtype} vs {expected_info.dtype}")
    elif comparison.same_shape and not _same_bytes(actual, expected, name):
        problems.append(
            f"{dtype} values differ (compared bit for bit: {dtype} has no float64 form)"
        )
    return comparison.result(problems, compared=False)


def _same_bytes(actual: Tensors, expected: Tensors, name: str) -> bool:
    size = actual.data_size(name)
    if size != expected.data_size(name):
        return False
    for start in range(0, size, COMPARED_BYTES):
        stop = start + COMPARED_BYTES
        if actual.read_data(name, start, stop) != expected.read_data(name, start, stop):
            return False
    return True


def _key_union(actual: Tensors, expected: Tensors) -> list[str]:
    """Keys of both files: actual's in file order, then those only expected has."""
    names = actual.keys()
    seen = set(names)
    return names + [k for k in expected if k not in seen]
