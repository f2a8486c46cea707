"""Comparing tensors, chunk by chunk, into plain data (``maskln diff`` and ``maskln verify``).

An element passes when ``|actual - expected| <= atol + rtol * |expected|`` (computed in float64);
NaN matches NaN only at the same position, and inf matches only the same inf. A
:class:`Comparison` is fed consecutive chunks of whole rows and keeps only running figures, so
multi-GB tensors compare in bounded memory. :func:`diff_files` compares two files key by key;
:mod:`maskln_cli.verify` feeds recomputed chunks. Rendering is :mod:`maskln_cli.report`'s job.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from maskln_cli.errors import MasklnError
from maskln_cli.tensorfile import TensorFile, open_tensor_file, torch_dtype
from maskln_cli.tensorfile import dtype_name as _dtype_name

if TYPE_CHECKING:
    import torch

    from maskln_cli.validrows import RowMask

# (rtol, atol) by dtype, as torch.testing.assert_close has them; other dtypes must be equal.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-7),
    "float32": (1.3e-6, 1e-5),
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
}
WORST_ROWS = 5
"""How many of the worst rows a comparison keeps for the report."""
CHUNK_ELEMENTS = 1 << 22
"""Elements compared at a time (rounded to whole rows): a few float64 temporaries of 32 MiB."""


@functools.cache
def converts_to_float64(dtype: torch.dtype | None) -> bool:
    """Whether values of ``dtype`` can be compared as float64 (not complex, not float4).

    Example:
        >>> import torch
        >>> converts_to_float64(torch.bfloat16), converts_to_float64(torch.complex64)
        (True, False)
    """
    import torch

    if dtype is None or dtype.is_complex:
        return False
    try:
        torch.zeros(1, dtype=dtype).double()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def default_tolerance(*dtypes: str) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing these dtypes: the loosest of their defaults.

    Example:
        >>> default_tolerance("float32"), default_tolerance("float32", "bfloat16")
        ((1.3e-06, 1e-05), (0.016, 1e-05))
    """
    pairs = [DEFAULT_TOLERANCES.get(d, (0.0, 0.0)) for d in dtypes]
    return max(r for r, _ in pairs), max(a for _, a in pairs)


@dataclass
class WorstRow:
    """A mismatched row: its leading index, the channel of its worst element, both values."""

    row: list[int]
    index: list[int]
    actual: float
    expected: float
    abs_diff: float


@dataclass
class TensorComparison:
    """The outcome for one key. ``problems`` says in words why it failed (empty if it passed).

    Value figures are ``None`` when the values could not be compared (a key missing on one side,
    or shapes that differ). Indices are lists of ints into the tensor; ``max_rel_diff`` is
    ``inf`` when the largest relative difference is at an expected 0.
    """

    name: str
    passed: bool
    problems: list[str]
    shape: list[int] | None
    expected_shape: list[int] | None
    dtype: str | None
    expected_dtype: str | None
    rtol: float
    atol: float
    numel: int | None = None
    rows: int | None = None
    mismatched: int | None = None
    mismatched_fraction: float | None = None
    mismatched_rows: int | None = None
    max_abs_diff: float | None = None
    max_abs_index: list[int] | None = None
    max_rel_diff: float | None = None
    max_rel_index: list[int] | None = None
    rel_l2: float | None = None
    nan_mismatched: int | None = None
    inf_mismatched: int | None = None
    invalid_rows_zero: bool | None = None
    worst: list[WorstRow] = field(default_factory=list)
    rows_left_out: int | None = None
    """Rows a ``--valid`` mask left out of the comparison (None: no mask applied)."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class ComparisonReport:
    """A whole comparison: every key's outcome and notes (such as gradients not checked)."""

    command: str
    actual: str
    expected: str
    tensors: list[TensorComparison]
    notes: list[str] = field(default_factory=list)
    eps: float | None = None
    """verify: the eps maskln computed with, and where it came from (``eps_source``)."""
    eps_source: str | None = None

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.tensors)

    def to_dict(self) -> dict[str, object]:
        document: dict[str, object] = {
            "passed": self.passed,
            "command": self.command,
            "actual": self.actual,
            "expected": self.expected,
        }
        if self.eps is not None:
            document.update(eps=self.eps, eps_source=self.eps_source)
        document.update(tensors=[t.to_dict() for t in self.tensors], notes=list(self.notes))
        return document


class Comparison:
    """Running comparison of one tensor, fed consecutive chunks of whole rows.

    Example:
        >>> import torch
        >>> comparison = Comparison("out", [2, 2], "float32", [2, 2], "float32")
        >>> comparison.update(torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 2.0]]))
        >>> comparison.update(torch.tensor([[3.0, 4.5]]), torch.tensor([[3.0, 4.0]]))
        >>> result = comparison.result()
        >>> result.passed, result.mismatched, result.max_abs_diff, result.max_abs_index
        (False, 1, 0.5, [1, 1])
    """

    def __init__(
        self,
        name: str,
        shape: Sequence[int],
        dtype: str,
        expected_shape: Sequence[int],
        expected_dtype: str,
        rtol: float | None = None,
        atol: float | None = None,
    ) -> None:
        default_rtol, default_atol = default_tolerance(dtype, expected_dtype)
        self.name = name
        self.shape = list(shape)
        self.expected_shape = list(expected_shape)
        self.dtype = dtype
        self.expected_dtype = expected_dtype
        self._float64_forms = all(
            converts_to_float64(torch_dtype(d)) for d in (dtype, expected_dtype)
        )
        self.rtol = default_rtol if rtol is None else rtol
        self.atol = default_atol if atol is None else atol
        # Rows are the leading index; a tensor of rank 0 or 1 has one element per row.
        self.row_length = self.shape[-1] if len(self.shape) >= 2 else 1
        self.numel = math.prod(self.shape)
        self._offset = 0
        self._mismatched = 0
        self._mismatched_rows = 0
        self._nan_mismatched = 0
        self._inf_mismatched = 0
        self._max_abs = (-1.0, -1)
        self._max_rel = (-1.0, -1)
        self._diff_squares = 0.0
        self._expected_squares = 0.0
        self._invalid_rows_zero: bool | None = None
        # Heap of (score, -flat index, actual, expected): the worst rows seen so far.
        self._worst: list[tuple[float, int, float, float]] = []

    @property
    def same_shape(self) -> bool:
        return self.shape == self.expected_shape

    @property
    def comparable(self) -> bool:
        """Values can be compared (fed to :meth:`update`) when the shapes agree and both dtypes
        have a float64 form (see :func:`converts_to_float64`)."""
        return self.same_shape and self._float64_forms

    def chunk_rows(self) -> int:
        """Rows per chunk for :meth:`update`, about :data:`CHUNK_ELEMENTS` elements."""
        return max(1, CHUNK_ELEMENTS // max(1, self.row_length))

    def update(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        invalid_rows: torch.Tensor | None = None,
    ) -> None:
        """Compare the next chunk of rows; ``invalid_rows`` (bool, one per row) marks rows whose
        expected values must be exactly zero (masked layer-norm outputs)."""
        import torch

        a = actual.detach().reshape(-1).double()
        e = expected.detach().reshape(-1).double()
        if a.numel() != e.numel() or a.numel() % self.row_length:
            raise ValueError("chunks must hold the same whole rows of both tensors")
        a_nan, e_nan = a.isnan(), e.isnan()
        finite = a.isfinite() & e.isfinite()
        diff = torch.where(finite, (a - e).abs(), 0.0)
        bound = self.atol + self.rtol * e.abs()
        same = (a == e) | (a_nan & e_nan)  # covers equal infs, and NaN at the same place
        ok = same | (finite & (diff <= bound))
        bad = ~ok
        self._mismatched += int(bad.sum())
        self._nan_mismatched += int((a_nan != e_nan).sum())
        self._inf_mismatched += int(((a.isinf() | e.isinf()) & ~same & ~(a_nan | e_nan)).sum())

        self._track_max("_max_abs", diff)
        relative = torch.where(
            finite & (e != 0), diff / e.abs(), torch.where(finite & (diff > 0), math.inf, 0.0)
        )
        self._track_max("_max_rel", relative)
        self._diff_squares += float((diff * diff).sum())
        self._expected_squares += float(torch.where(finite, e * e, 0.0).sum())

        rows_bad = bad.view(-1, self.row_length)
        self._mismatched_rows += int(rows_bad.any(dim=1).sum())
        # Worst rows: score each mismatched element (non-finite disagreements first).
        score = torch.where(bad, torch.where(finite, diff, math.inf), -1.0).view(
            -1, self.row_length
        )
        row_score, row_channel = score.max(dim=1)
        bad_rows = (row_score >= 0).nonzero().squeeze(1)
        if bad_rows.numel():
            # Stable sort: among equal scores the earliest rows win, whatever the chunking.
            order = row_score[bad_rows].sort(descending=True, stable=True).indices[:WORST_ROWS]
            for row in bad_rows[order].tolist():
                value = float(row_score[row])
                flat = row * self.row_length + int(row_channel[row])
                entry = (value, -(self._offset + flat), float(a[flat]), float(e[flat]))
                if len(self._worst) < WORST_ROWS:
                    heapq.heappush(self._worst, entry)
                else:
                    heapq.heappushpop(self._worst, entry)

        if invalid_rows is not None and bool(invalid_rows.any()):
            expected_rows = e.view(-1, self.row_length)[invalid_rows.reshape(-1)]
            zero = bool((expected_rows == 0).all())
            self._invalid_rows_zero = zero and self._invalid_rows_zero is not False
        self._offset += a.numel()

    def _track_max(self, attribute: str, values: torch.Tensor) -> None:
        if values.numel() == 0:
            return
        value, index = values.max(dim=0)
        if float(value) > getattr(self, attribute)[0]:
            setattr(self, attribute, (float(value), self._offset + int(index)))

    def result(self, extra_problems: Iterable[str] = (), compared: bool = True) -> TensorComparison:
        """The outcome, once every chunk has been fed.

        With ``compared=False`` (or shapes that differ) no values were fed, and the outcome
        holds the shapes, dtypes and problems only.
        """
        problems = list(extra_problems)
        if self.shape != self.expected_shape:
            problems.append(f"shape {self.shape} vs expected {self.expected_shape}")
        if self.dtype != self.expected_dtype:
            problems.append(f"dtype {self.dtype} vs expected {self.expected_dtype}")
        outcome = TensorComparison(
            name=self.name,
            passed=False,
            problems=problems,
            shape=self.shape,
            expected_shape=self.expected_shape,
            dtype=self.dtype,
            expected_dtype=self.expected_dtype,
            rtol=self.rtol,
            atol=self.atol,
        )
        if not (self.comparable and compared):
            outcome.passed = not problems
            return outcome
        if self._offset != self.numel:
            raise ValueError(f"compared {self._offset} of {self.numel} elements of {self.name!r}")
        rows = self.numel // self.row_length if self.row_length else 0
        outcome.numel = self.numel
        outcome.rows = rows
        outcome.mismatched = self._mismatched
        outcome.mismatched_fraction = float(self._mismatched / self.numel) if self.numel else 0.0
        outcome.mismatched_rows = self._mismatched_rows
        outcome.nan_mismatched = self._nan_mismatched
        outcome.inf_mismatched = self._inf_mismatched
        if self._max_abs[1] >= 0:
            outcome.max_abs_diff = self._max_abs[0]
            outcome.max_abs_index = self._unravel(self._max_abs[1])
            outcome.max_rel_diff = self._max_rel[0]
            outcome.max_rel_index = self._unravel(self._max_rel[1])
        if self._expected_squares > 0:
            outcome.rel_l2 = math.sqrt(self._diff_squares / self._expected_squares)
        else:
            outcome.rel_l2 = 0.0 if self._diff_squares == 0 else math.inf
        outcome.invalid_rows_zero = self._invalid_rows_zero
        outcome.worst = [
            self._worst_row(-negative_flat, actual, expected, score)
            for score, negative_flat, actual, expected in sorted(self._worst, reverse=True)
        ]
        if self._mismatched:
            problems.append(
                f"{self._mismatched:,} of {self.numel:,} elements differ beyond tolerance"
            )
        if self._invalid_rows_zero is False:
            problems.append("expected is not exactly 0 at every invalid position")
        outcome.passed = not problems
        return outcome

    def _worst_row(self, flat: int, actual: float, expected: float, score: float) -> WorstRow:
        index = self._unravel(flat)
        return WorstRow(
            row=index[:-1] if len(self.shape) >= 2 else index,
            index=index,
            actual=actual,
            expected=expected,
            abs_diff=score,
        )

    def _unravel(self, flat: int) -> list[int]:
        index = []
        for size in reversed(self.shape):
            flat, position = divmod(flat, size) if size else (flat, 0)
            index.append(position)
        return index[::-1]


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
    (see :mod:`maskln_cli.validrows`).

    Example:
        >>> import torch
        >>> result = compare_tensors("t", torch.tensor([1.0, float("nan")]),
        ...                          torch.tensor([1.0, float("nan")]))
        >>> result.passed, result.nan_mismatched
        (True, 0)
    """
    comparison = Comparison(
        name,
        list(actual.shape),
        _dtype_name(actual.dtype),
        list(expected.shape),
        _dtype_name(expected.dtype),
        rtol,
        atol,
    )
    if not (converts_to_float64(actual.dtype) and converts_to_float64(expected.dtype)):
        return comparison.result(_compare_bytes(actual, expected, comparison), compared=False)
    from maskln_cli.validrows import count_left_out, leave_out

    if comparison.comparable and comparison.numel:
        step = comparison.chunk_rows() * comparison.row_length
        flat_actual, flat_expected = actual.reshape(-1), expected.reshape(-1)
        for start in range(0, comparison.numel, step):
            chunk_actual = flat_actual[start : start + step]
            chunk_expected = flat_expected[start : start + step]
            if keep_rows is not None:
                row = start // comparison.row_length
                rows = chunk_actual.numel() // comparison.row_length
                keep = keep_rows[row : row + rows]
                chunk_actual, chunk_expected = leave_out(chunk_actual, chunk_expected, keep)
            comparison.update(chunk_actual, chunk_expected)
    outcome = comparison.result()
    if keep_rows is not None and comparison.comparable:
        count_left_out(outcome, int((~keep_rows).sum()))
    return outcome


def _compare_bytes(
    actual: torch.Tensor, expected: torch.Tensor, comparison: Comparison
) -> list[str]:
    """Tensors whose values have no float64 form (complex, float4) must be equal bit for bit."""
    import torch

    dtype = _dtype_name(actual.dtype)
    if not comparison.same_shape or actual.dtype != expected.dtype:
        return [f"values not compared: {dtype} vs {_dtype_name(expected.dtype)}"]
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
) -> ComparisonReport:
    """Compare two safetensors files key by key (``-`` for stdin, on one side at most).

    With ``keys``, only those keys are compared (each must exist on at least one side). With
    ``valid`` (``FILE[:KEY]``, a mask), tensors of shape ``[*mask.shape, C]`` are compared on
    the mask's valid rows only.

    Example:
        >>> report = diff_files("sample_data/worked_example.safetensors",
        ...                     "sample_data/worked_example.safetensors")
        >>> report.passed, [t.name for t in report.tensors]
        (True, ['bias', 'scale', 'x', 'valid'])
    """
    if [actual_path, expected_path].count("-") > 1:
        raise MasklnError("ACTUAL and EXPECTED cannot both be '-' (stdin)")
    if valid is not None and "-" in (actual_path, expected_path):
        from maskln_cli.validrows import parse_mask_spec

        if parse_mask_spec(valid)[0] == "-":
            raise MasklnError("--valid cannot read stdin when ACTUAL or EXPECTED does")
    check_tolerance(rtol, "--rtol")
    check_tolerance(atol, "--atol")
    with contextlib.ExitStack() as stack:
        actual = stack.enter_context(open_tensor_file(actual_path))
        expected = stack.enter_context(open_tensor_file(expected_path))
        names = _key_union(actual, expected)
        if keys:
            unknown = [k for k in keys if k not in names]
            if unknown:
                raise MasklnError(
                    f"--key: {unknown[0]!r} is in neither {actual.name} nor {expected.name}"
                )
            names = [k for k in names if k in set(keys)]
        notes: list[str] = []
        mask = None
        if valid is not None:
            from maskln_cli.validrows import open_row_mask, row_mask_notes

            mask = stack.enter_context(open_row_mask(valid))
            notes += row_mask_notes(mask, {n: _shape(actual, expected, n) for n in names})
        tensors = list(_compare_keys(actual, expected, names, rtol, atol, mask))
        return ComparisonReport("diff", actual.name, expected.name, tensors, notes)


def _shape(actual: TensorFile, expected: TensorFile, name: str) -> tuple[int, ...]:
    return (actual if name in actual else expected).info(name).shape


def _compare_keys(
    actual: TensorFile,
    expected: TensorFile,
    names: Sequence[str],
    rtol: float | None,
    atol: float | None,
    mask: RowMask | None = None,
) -> Iterator[TensorComparison]:
    for name in names:
        if name not in actual:
            info = expected.info(name)
            yield missing(name, "actual", info.shape, info.dtype)
        elif name not in expected:
            info = actual.info(name)
            yield missing(name, "expected", info.shape, info.dtype)
        else:
            keep = mask.keep if mask and mask.applies_to(actual.info(name).shape) else None
            yield compare_tensors(
                name, actual.tensor(name), expected.tensor(name), rtol, atol, keep
            )


def _key_union(actual: TensorFile, expected: TensorFile) -> list[str]:
    """Keys of both files: actual's in file order, then those only expected has."""
    names = actual.keys()
    seen = set(names)
    return names + [k for k in expected if k not in seen]


def check_tolerance(value: float | None, option: str) -> None:
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise MasklnError(f"{option}: must be a finite number >= 0, got {value}")
