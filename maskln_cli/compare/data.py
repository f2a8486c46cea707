"""What a comparison finds, as plain data: the figures of each tensor and of a whole report,
the default tolerances, and the conversion of any of it to JSON-ready values; and what a
comparison is given for each element besides its values.

Rendering is the command line's job; this module only holds the numbers.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, NamedTuple

from maskln_cli.errors import MasklnError
from maskln_cli.files.tensorfile import torch_dtype

if TYPE_CHECKING:
    import torch


# (rtol, atol) by dtype, as torch.testing.assert_close has them; other dtypes must be equal.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-7),
    "float32": (1.3e-6, 1e-5),
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
}
WORST_ROWS = 5
"""How many of the worst rows a comparison keeps for the report."""
INTEGRAL_DTYPES = frozenset(
    ("bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64")
)
"""The dtypes compared exactly, in their own values (:class:`IntegerComparison`)."""


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


def has_values(dtype: str) -> bool:
    """Whether a tensor of ``dtype`` (a name from
    :data:`~maskln_cli.files.tensorfile.DTYPE_NAMES`, or a safetensors code torch has no dtype
    for) has values maskln can read: not complex, F4 (float4_e2m1fn_x2 in torch, two values a
    byte) or F6; those are compared bit for bit.

    Example:
        >>> has_values("float8_e4m3fn"), has_values("F6_E2M3"), has_values("complex64")
        (True, False, False)
    """
    return dtype == "bool" or converts_to_float64(torch_dtype(dtype))


def default_tolerance(*dtypes: str) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing these dtypes: the loosest of their defaults.

    Example:
        >>> default_tolerance("float32"), default_tolerance("float32", "bfloat16")
        ((1.3e-06, 1e-05), (0.016, 1e-05))
    """
    pairs = [DEFAULT_TOLERANCES.get(d, (0.0, 0.0)) for d in dtypes]
    return max(r for r, _ in pairs), max(a for _, a in pairs)


RECORDED_ROWS = 4096
"""How many failing rows a comparison remembers (by index), for a diagnosis afterwards."""


def plain_data(value: object) -> object:
    """``value`` as plain data, as :func:`dataclasses.asdict` makes it (dataclasses as dicts of
    their fields, lists, tuples and dicts copied, all the way down), several times faster:
    asdict deep-copies every number, which is most of the time ``diff --json`` spends on a
    file of many tiny tensors.

    Example:
        >>> plain_data(WorstRow([1], [1, 2], 3.0, 4, 1))
        {'row': [1], 'index': [1, 2], 'actual': 3.0, 'expected': 4, 'abs_diff': 1, 'allowed': None}
    """
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is list:
        return [plain_data(v) for v in value]  # type: ignore[attr-defined]
    if kind is dict:
        return {plain_data(k): plain_data(v) for k, v in value.items()}  # type: ignore[attr-defined]
    if is_dataclass(value) and not isinstance(value, type):
        document = {name: getattr(value, name) for name in _field_names(kind)}
        for name, item in document.items():
            if type(item) not in _SCALARS:
                document[name] = plain_data(item)
        return document
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple: as asdict
        return kind(*(plain_data(v) for v in value))
    if isinstance(value, list | tuple):
        return kind(plain_data(v) for v in value)  # type: ignore[call-arg]
    if isinstance(value, dict):
        return kind((plain_data(k), plain_data(v)) for k, v in value.items())  # type: ignore[call-arg]
    return copy.deepcopy(value)


_SCALARS = frozenset((int, float, str, bool, type(None)))


@functools.cache
def _field_names(kind: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(kind))


@dataclass
class WorstRow:
    """A mismatched row: its leading index, the channel of its worst element, both values, and
    what that element was allowed to differ by (``allowed``: the tolerance or the budget)."""

    row: list[int]
    index: list[int]
    actual: float | int
    expected: float | int
    abs_diff: float | int
    allowed: float | None = None


@dataclass
class RowErrors:
    """The relative error ``||a - e|| / ||e||`` of each valid row (rows whose expected values
    are finite and not all 0): how many, their mean and spread, the smallest and the largest.
    A formula mistake errs about the same on every row; rounding does not."""

    rows: int
    mean: float
    std: float
    min: float
    max: float


class PerElement(NamedTuple):
    """What :meth:`Comparison.update` may be given for each element of a chunk besides its
    actual and expected values (None: not given): the allowance, a yardstick, and the budget
    unit and what is always allowed that the allowance was made of."""

    allowance: torch.Tensor | None = None
    yardstick: torch.Tensor | None = None
    budget_unit: torch.Tensor | None = None
    always: torch.Tensor | None = None


@dataclass
class BlockFigures:
    """What :meth:`Comparison.measure` finds in a block of whole rows with finite values: the
    per-row figures, and the elementwise maxima with their indices into the block."""

    rows: int
    counts: torch.Tensor | None  # elements beyond their allowance, per row (None: none)
    max_abs: tuple[float, int, float, float, float]  # value, index, actual, expected, allowed
    max_rel: tuple[float, int]
    max_ratio: float
    factor_needed: float
    row_squares: torch.Tensor
    row_norms: torch.Tensor
    # Rows with an element beyond: row, score, index, actual, expected, allowed (tensors).
    worst: tuple[torch.Tensor, ...] | None = None
    yardstick_max: float = -1.0
    yardstick_rows: torch.Tensor | None = None
    padding: tuple[bool, int] | None = None  # invalid rows: all exactly 0, how many -0.0
    # The allowance of the greatest difference when max_abs leaves it out (NaN): made only
    # if this block's greatest difference is reported.
    allowed_later: Callable[[], float] | None = None
    # ``actual - expected`` in float64, flat, when asked (``keep_error``): for whoever regresses
    # it next, not made again.
    error: torch.Tensor | None = None


@dataclass
class TensorComparison:
    """The outcome for one key. ``problems`` says in words why it failed (empty if it passed).

    Value figures are ``None`` when the values could not be compared (a key missing on one side,
    or shapes that differ). Indices are lists of ints into the tensor; ``max_rel_diff`` is
    ``inf`` when the largest relative difference is at an expected 0. For integer and bool
    tensors ``max_abs_diff`` and the values in ``worst`` are exact Python ints.
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
    max_abs_diff: float | int | None = None
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
    budget_ratio: float | None = None
    yardstick_max_abs_diff: float | None = None
    yardstick_rel_l2: float | None = None
    nan_where_finite: int | None = None
    inf_where_finite: int | None = None
    mismatched_invalid_rows: int | None = None
    negative_zeros: int | None = None
    row_rel_error: RowErrors | None = None
    factor_needed: float | None = None
    diagnosis: list[dict[str, object]] = field(default_factory=list)
    systematic: dict[str, object] | None = None
    """verify: a systematic error found in the valid rows (None, and left out of JSON, when
    none was found; see :mod:`maskln_cli.verify.systematic`)."""
    explanation: str | None = None
    """verify: what is wrong, in one phrase, as the verdict line says it (None: passed, or not
    given; the verdict line then says the first problem)."""

    def to_dict(self) -> dict[str, object]:
        document: dict[str, object] = plain_data(self)  # type: ignore[assignment]
        for name in ("systematic", "explanation"):
            if document[name] is None:
                del document[name]
        return document


@dataclass
class ComparisonReport:
    """A whole comparison: every key's outcome and notes (such as gradients not checked)."""

    command: str
    actual: str
    expected: str
    tensors: list[TensorComparison]
    notes: list[str] = field(default_factory=list)
    context: dict[str, object] = field(default_factory=dict)
    """What the comparison was made with, for ``verify``: eps and its source, rows, dtypes,
    the tolerance mode (see :mod:`maskln_cli.verify`); JSON carries it at the top level."""

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.tensors)

    def to_dict(self) -> dict[str, object]:
        document: dict[str, object] = {
            "passed": self.passed,
            "command": self.command,
            "actual": self.actual,
            "expected": self.expected,
            **self.context,
            "tensors": [t.to_dict() for t in self.tensors],
            "notes": list(self.notes),
        }
        return document


def times(ratio: float) -> str:
    """A ratio as reports print it: ``1.1x``, ``3,412x``.

    Example:
        >>> times(1.08), times(3412.5)
        ('1.1x', '3,412x')
    """
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.2g}x"


def check_tolerance(value: float | None, option: str) -> None:
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise MasklnError(f"{option}: must be a finite number >= 0, got {value}")
