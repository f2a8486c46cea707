"""What ``maskln verify`` is asked: the tensors RESULT may hold, and the options that judge them.

:class:`VerifyOptions` holds the options ``verify`` has beyond ``normalize``'s;
:func:`parse_check` and :func:`parse_result_keys` read the repeatable ``--check`` and
``--result-key``, and :func:`check_options` rejects what cannot be judged before any file is
opened.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from maskln_cli.compare.data import check_tolerance
from maskln_cli.errors import MasklnError
from maskln_cli.files.problem import GRADIENT_KEYS

TENSORS = ("out", *GRADIENT_KEYS)
"""What RESULT may hold, by the names the report uses."""
ROW_TENSORS = ("out", "grad_x")
"""Tensors of x's shape: their invalid rows must be exactly 0."""
TOLERANCE_MODES = ("budget", "fixed")
JUDGE_DTYPES = ("auto", "float64", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class VerifyOptions:
    """How RESULT is judged (the options ``maskln verify`` has beyond ``normalize``'s).

    ``check`` limits the tensors checked (default: ``out``, and the three gradients when INPUT
    holds ``grad_out``); ``result_keys`` maps those names to RESULT's keys. ``tolerance`` is
    ``budget`` or ``fixed`` (default: budget, unless ``rtol`` or ``atol`` is given); ``dtype``
    is the dtype the kernel is judged in (``auto``: each tensor's own). ``strict`` also fails
    -0.0 in the padding and any key of RESULT that was not compared.
    """

    check: tuple[str, ...] | None = None
    result_keys: Mapping[str, str] = field(default_factory=dict)
    tolerance: str | None = None
    factor: float | None = None
    rtol: float | None = None
    atol: float | None = None
    strict: bool = False
    dtype: str = "auto"
    valid: str | None = None
    plain_layer_norm: bool = False
    """RESULT is a plain LayerNorm's output (a model's own): its padding is not zeroed. The
    reference normalizes every row, and only the valid rows are compared."""
    allow_systematic: bool = False
    """Report a systematic error within the budget without failing on it."""

    @property
    def mode(self) -> str:
        if self.tolerance is not None:
            return self.tolerance
        return "fixed" if (self.rtol, self.atol) != (None, None) else "budget"


def parse_check(values: Iterable[str]) -> tuple[str, ...]:
    """``--check out,grad_x`` (repeatable) as a tuple of names.

    Example:
        >>> parse_check(["out, grad_x", "grad_bias"])
        ('out', 'grad_x', 'grad_bias')
    """
    names: list[str] = []
    for value in values:
        for name in (part.strip() for part in value.split(",")):
            if name not in TENSORS:
                raise MasklnError(
                    f"--check: unknown tensor {name!r}; choose from {', '.join(TENSORS)}"
                )
            if name not in names:
                names.append(name)
    return tuple(names)


def parse_result_keys(values: Iterable[str]) -> dict[str, str]:
    """``--result-key out=y`` (repeatable) as ``{"out": "y"}``.

    Example:
        >>> parse_result_keys(["out=y", "grad_x=dx"])
        {'out': 'y', 'grad_x': 'dx'}
    """
    mapping: dict[str, str] = {}
    for value in values:
        name, sign, key = value.partition("=")
        name = name.strip()
        if not sign or not key:
            raise MasklnError(f"--result-key: expected NAME=KEY such as out=y, got {value!r}")
        if name not in TENSORS:
            raise MasklnError(
                f"--result-key: unknown tensor {name!r} in {value!r}; choose from"
                f" {', '.join(TENSORS)}"
            )
        if name in mapping and mapping[name] != key:
            raise MasklnError(f"--result-key: {name} is mapped twice ({mapping[name]!r}, {key!r})")
        mapping[name] = key
    return mapping


def check_options(verify: VerifyOptions) -> None:
    """Reject options that cannot judge anything, before INPUT or RESULT is read."""
    check_tolerance(verify.rtol, "--rtol")
    check_tolerance(verify.atol, "--atol")
    if verify.tolerance is not None and verify.tolerance not in TOLERANCE_MODES:
        raise MasklnError(f"--tolerance: must be budget or fixed, got {verify.tolerance!r}")
    if verify.factor is not None:
        if not (math.isfinite(verify.factor) and verify.factor >= 1):
            raise MasklnError(f"--factor: must be a finite number >= 1, got {verify.factor}")
        if verify.mode == "fixed":
            raise MasklnError("--factor applies to the error budget, not to --tolerance fixed")
    if verify.dtype not in JUDGE_DTYPES:
        raise MasklnError(
            f"--dtype: must be one of {', '.join(JUDGE_DTYPES)}, got {verify.dtype!r}"
        )
    unknown = set(verify.check or ()) - set(TENSORS)
    if unknown:
        raise MasklnError(f"--check: unknown tensor {sorted(unknown)[0]!r}")
