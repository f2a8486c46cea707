"""Which rows a wrong output treated as valid: the op is row by row, so each row of an output is
either the row normalized (taken as valid), zeros (taken as padding), or neither. From that, two
mistakes no formula of the inputs gives (:func:`diagnose_rows`):

- the output is right for another mask than this call's ``valid`` (a mask cached between calls,
  by shape, in a global or on a tensor; or ``valid`` reshaped or transposed): ``stale_mask``;
- the valid rows are right, the invalid rows hold values nothing computes (uninitialized memory:
  an output from ``torch.empty_like`` written at the valid rows only): ``output_uninitialized``.

An inverted mask is a formula (``mask_inverted`` in :data:`maskln_cli.op.mistakes.MISTAKES`),
named here too when the padding is poisoned (where formulas give NaN).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from maskln_cli.grading.clauses.cases import Case
from maskln_cli.op.mistakes import MISTAKES, Diagnosis, correct

STALE_MASK = Diagnosis(
    "stale_mask",
    "the output is right for another mask than this call's valid: rows taken as valid or as"
    " padding by a mask kept from an earlier call (cached by shape, in a global or on a"
    " tensor), or by valid reshaped or transposed",
    "use this call's valid, in every call: keep = valid[..., None]; cache nothing between calls",
    0.0,
)
UNINITIALIZED = Diagnosis(
    "output_uninitialized",
    "invalid rows never written: the output comes from torch.empty / empty_like (whatever"
    " memory held) and only the valid rows are filled",
    "start from torch.zeros_like(x), or write zeros into the invalid rows:"
    " torch.where(valid[..., None], y, 0.0)",
    0.0,
)

ROW_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
"""How close a row must be to the row normalized to count as taken for valid (a few times a
correct kernel's rounding; tighter than any formula mistake's distance)."""


def row_kinds(
    case: Case, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Per row (flattened leading axes): taken as valid (the row normalized), taken as padding
    (exactly zero), and known (a row whose normalization is finite: a poisoned row's is NaN
    however it is taken); None when the shapes differ. A row can be neither."""
    t = case.inputs()
    if tuple(out.shape) != tuple(t["x"].shape) or out.numel() == 0:
        return None
    channels = out.shape[-1]
    every = torch.ones_like(t["valid"])
    with torch.no_grad():
        full = correct(t["x"].double(), every, t["scale"].double(), t["bias"].double(), case.eps)
    got = out.double().reshape(-1, channels)
    full = full.reshape(-1, channels)
    tolerance = ROW_TOLERANCE.get(case.x.dtype, ROW_TOLERANCE[torch.float32])
    allowed = tolerance * (1 + full.abs().nan_to_num(0.0, 0.0, 0.0))
    if case.x.dtype != torch.float64:  # rows far from zero round loudly in float32
        allowed = allowed + 10 * _rounding(t, every, case.eps, full)
    same_finite = (got.isfinite() == full.isfinite()).all(-1)
    gap = torch.where(full.isfinite() & got.isfinite(), (got - full).abs(), 0.0)
    close = (gap <= allowed).all(-1)
    as_valid = same_finite & close
    as_padding = (got == 0).all(-1)
    return as_valid, as_padding, full.isfinite().all(-1)


def _rounding(
    t: dict[str, torch.Tensor], every: torch.Tensor, eps: float, full: torch.Tensor
) -> torch.Tensor:
    """How far a plain float32 kernel's rows are from the float64 ones, per row ([rows, 1]):
    the rounding a correct kernel may show on this data (large on rows far from zero)."""
    with torch.no_grad():
        single = correct(t["x"].float(), every, t["scale"].float(), t["bias"].float(), eps)
    gap = (single.double().reshape(full.shape) - full).abs().nan_to_num(0.0, 0.0, 0.0)
    return gap.amax(-1, keepdim=True)


def diagnose_rows(case: Case, out: torch.Tensor, earlier: Sequence[Case] = ()) -> Diagnosis | None:
    """``stale_mask`` or ``output_uninitialized`` when the output's rows say so (``earlier``:
    the cases called before this one, whose masks a cache may hold), else None."""
    kinds = row_kinds(case, out)
    if kinds is None:
        return None
    as_valid, as_padding, known = kinds
    valid = case.inputs()["valid"].reshape(-1)[known]
    as_valid, as_padding = as_valid[known], as_padding[known]
    if not bool(known.any()):
        return None
    if bool((as_valid | as_padding).all()):
        used = as_valid & ~as_padding
        # Every row normalized is no mask at all (the catalogue's padding_not_masked).
        if bool(used.all()) or bool((used == valid).all()):
            return None
        if bool((used == ~valid).all()):
            inverted = MISTAKES["mask_inverted"]
            return Diagnosis(inverted.name, inverted.description, inverted.fix, 0.0)
        return _with_earlier(used, valid, known, earlier)
    neither = ~(as_valid | as_padding)
    if bool(as_valid[valid].all()) and bool((~valid[neither]).all()):
        return UNINITIALIZED
    return None


def _with_earlier(
    used: torch.Tensor, valid: torch.Tensor, known: torch.Tensor, earlier: Sequence[Case]
) -> Diagnosis:
    """The stale-mask diagnosis, saying whose mask it was when an earlier case's is it (on the
    ``known`` rows)."""
    for case in reversed(earlier):
        other = case.inputs()["valid"].reshape(-1)
        if other.shape == known.shape and bool((other[known] == used).all()):
            return Diagnosis(
                STALE_MASK.mistake,
                f"{STALE_MASK.description} (here the mask of an earlier call, {case.label})",
                STALE_MASK.fix,
                0.0,
            )
    return STALE_MASK


def sign_of_multiplied_zeros(case: Case, out: torch.Tensor) -> bool:
    """Whether the -0.0 in the invalid rows of ``out`` are where multiplying by the mask puts
    them: at the negative entries of what was multiplied (bias, for sanitized rows; the row
    normalized, for unsanitized ones). Zeros nothing wrote (uninitialized memory) are not."""
    t = case.inputs()
    invalid = case.invalid()
    zeros = invalid & (out == 0)
    if not bool(zeros.any()):
        return False
    negative = torch.signbit(out)[zeros]
    with torch.no_grad():
        every = torch.ones_like(t["valid"])
        full = correct(t["x"].double(), every, t["scale"].double(), t["bias"].double(), case.eps)
    bias = t["bias"].double().expand(out.shape)
    return any(bool((negative == (multiplied[zeros] < 0)).all()) for multiplied in (bias, full))
