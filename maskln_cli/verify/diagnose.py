"""Which mistake a failing tensor of ``maskln verify`` is: one diagnosis, from a bounded sample.

The known wrong formulas of :mod:`maskln_cli.op.mistakes` are evaluated on a bounded sample of
a tensor's failing rows, re-read from INPUT and RESULT (:func:`take_sample`), the candidates an
earlier tensor of the same RESULT was explained by first (:func:`diagnose_rows`). What the
systematic-error test found is said as a diagnosis too (:func:`eps_diagnosis`,
:func:`mistake_diagnosis`), so that a tensor's problem line and its likely mistake are one
explanation. Errors matching no formula are measured against the rounding of a kernel that
stores, or accumulates, in a coarser dtype (:func:`precision_diagnosis`): "errors look like
float16 rounding: accumulate in float32".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from maskln_cli.files.masks import RowMask
    from maskln_cli.files.problem import Problem
    from maskln_cli.files.tensorfile import TensorFile
    from maskln_cli.op.mistakes import Diagnosis, Mistake
    from maskln_cli.verify.systematic import Finding

DIAGNOSIS_ELEMENTS = 1 << 17
"""At most this many elements of failing rows are re-read for a diagnosis: enough to tell the
formulas apart many times over (each is judged by a relative L2 distance over all of them), few
enough that a failing verify costs little more than a passing one (benchmark figure 17)."""
PRECISIONS = ("float32", "float16", "bfloat16")
"""The dtypes whose rounding a failing tensor's errors are measured in, finest first."""
ACCUMULATED = (0.05, 0.08)
"""Errors of sums accumulated in a dtype of unit roundoff u are, relative, between
``ACCUMULATED[0] * u`` and ``ACCUMULATED[1] * C * u``: a float16 sequential sum's 0.012 to 0.033
C u from C = 16 to 4,096; a bfloat16 one's, in float16's u, 0.14 to 0.27."""
STORED = (0.2, 2.0)
"""Values rounded to a dtype of unit roundoff u err, relative, by ``STORED[0] * u`` to
``STORED[1] * u``: float16 and bfloat16 outputs 0.65 to 0.75 u; bfloat16's in float16's u, 5.7."""


@dataclass
class Sample:
    """Rows of INPUT and RESULT re-read for a diagnosis, in their leading shape."""

    problem: Problem
    actual: torch.Tensor
    x: torch.Tensor
    valid: torch.Tensor
    grad_out: torch.Tensor | None

    def reference(self, name: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The truth (float64) and PyTorch's result in ``dtype`` for ``name`` on these rows."""
        from maskln_cli.verify.blockwork import float64_truth
        from maskln_cli.verify.budget import yardstick

        problem = self.problem
        channels = problem.channels
        rows, valid = self.x.reshape(-1, channels), self.valid.reshape(-1)
        upstream = self.grad_out.reshape(-1, channels) if name == "grad_x" else None
        dy64 = upstream.double() if upstream is not None else None
        truth = float64_truth(problem, rows.double(), valid, dy64)[0][name]
        guess = yardstick(rows, valid, problem.scale, problem.bias, problem.eps, dtype, upstream)
        value = guess.out if upstream is None else guess.grad_x
        assert value is not None
        return truth.reshape(self.x.shape), value.double().reshape(self.x.shape)


def take_sample(
    problem: Problem, result: TensorFile, key: str, rows: Sequence[int], mask: RowMask | None
) -> Sample:
    """The failing ``rows`` of RESULT's ``key`` and their surroundings, at most
    :data:`DIAGNOSIS_ELEMENTS` elements: whole sequences (the last leading axis) when they
    fit, so that a mistake along that axis shows, else the rows themselves."""
    import torch

    budget = max(2, DIAGNOSIS_ELEMENTS // problem.channels)
    if len(problem.shape) >= 3 and problem.shape[-2] <= budget:
        length = problem.shape[-2]
        sequences = list(dict.fromkeys(row // length for row in rows))[: budget // length]
        starts = torch.tensor(sequences, dtype=torch.long).unsqueeze(1) * length
        index = (starts + torch.arange(length)).reshape(-1)
        leading: tuple[int, ...] = (len(sequences), length)
    elif len(problem.shape) == 2 and problem.rows <= budget:
        index, leading = torch.arange(problem.rows), (problem.rows,)
    else:
        index = torch.tensor(list(rows)[:budget], dtype=torch.long)
        leading = (len(index),)
    shape = (*leading, problem.channels)
    actual = result.tensor(key).reshape(-1, problem.channels)[index]
    grad_out = problem.grad_out[index].reshape(shape) if problem.grad_out is not None else None
    valid = problem.valid[index]
    if mask is not None:
        # Rows --valid left out are never blamed: the diagnosis sees them as padding, zero on
        # RESULT's side as on the reference's.
        keep = mask.keep[index]
        valid = valid & keep
        actual = torch.where(keep.unsqueeze(1), actual, torch.zeros((), dtype=actual.dtype))
    return Sample(
        problem, actual.reshape(shape), problem.x[index].reshape(shape), valid.reshape(leading),
        grad_out,
    )  # fmt: skip


def diagnose_rows(
    name: str,
    sample: Sample,
    judge: torch.dtype,
    truth: torch.Tensor,
    noise: float,
    candidates: dict[str, Mistake] | None = None,
    systematic: bool = False,
    catalogue: bool = True,
) -> Diagnosis | None:
    """The mistake out or grad_x (``name``) on ``sample`` matches best: among ``candidates``
    first (an earlier tensor's explanation, tried alone: one formula, not the catalogue),
    then the catalogue's formulas, then the rounding of a coarser dtype (unless the tensor's
    error is ``systematic``, which rounding is not, or an earlier tensor's was a formula's:
    the caller says so; without ``catalogue``, its formulas are not tried). ``truth`` is the
    sample's float64 truth, ``noise`` PyTorch's relative distance from it in ``judge``."""
    from maskln_cli.op import mistakes as formulas

    problem = sample.problem
    args = (sample.x, sample.valid, problem.scale, problem.bias)
    tries = ([candidates] if candidates else []) + ([None] if catalogue else [])
    for mistakes in tries:
        if name == "out":
            found = formulas.diagnose_output(
                sample.actual, *args, problem.eps, judge, noise=noise, mistakes=mistakes
            )
        else:
            assert sample.grad_out is not None
            found = formulas.diagnose_gradient(
                sample.actual, *args, sample.grad_out, problem.eps, judge, noise=noise,
                mistakes=mistakes,
            )  # fmt: skip
        if found:
            return found[0]
    return None if systematic else precision_diagnosis(name, sample, truth)


def precision_diagnosis(name: str, sample: Sample, truth: torch.Tensor) -> Diagnosis | None:
    """Errors of the size a kernel in a coarser dtype makes, and no formula's: the finest dtype
    of :data:`PRECISIONS` (coarser than the result's) whose rounding they are the size of.

    Each valid row's error is split (:func:`split_errors`) into what its statistics' rounding
    makes (a factor along the row's truth, a shift, and for grad_x a part along xhat: each
    row's own) and what is left element by element. Errors mostly of the first kind come from
    sums over a row accumulated in a coarse dtype: their size, relative, is within
    :data:`ACCUMULATED` units of that dtype's rounding (a sum of C terms errs by up to C of
    them). Errors mostly of the second are values rounded to a coarse dtype on the way:
    within :data:`STORED` units. The description gives their size in ulps of each dtype."""
    import torch

    from maskln_cli.op.mistakes import Diagnosis
    from maskln_cli.verify.budget import unit_roundoff

    split = split_errors(name, sample, truth)
    if split is None:
        return None
    structured, elementwise = split
    accumulated = structured >= elementwise
    size = structured if accumulated else elementwise
    relative = math.hypot(structured, elementwise)
    channels = sample.problem.channels
    stored = torch.finfo(sample.actual.dtype).eps
    for dtype_name in PRECISIONS:
        dtype = getattr(torch, dtype_name)
        if torch.finfo(dtype).eps <= stored:
            continue  # not coarser than what RESULT holds
        u = unit_roundoff(dtype)
        low, high = (ACCUMULATED[0] * u, ACCUMULATED[1] * channels * u) if accumulated else (
            STORED[0] * u, STORED[1] * u)  # fmt: skip
        if not low <= size <= high:
            continue
        ulps = ", ".join(
            f"{relative / torch.finfo(getattr(torch, d)).eps:,.2g} of {d}" for d in PRECISIONS
        )
        if accumulated:
            how = "mostly in each row's statistics, as sums accumulated in"
            fix = (
                "accumulate in float32: the row sums (mean, variance, and the backward's) in"
                " float32, whatever the dtype of the values"
            )
        else:
            how = "element by element, as values rounded to"
            fix = "compute in float32: no value rounded to a coarser dtype on the way"
        return Diagnosis(
            f"rounding_{dtype_name}",
            f"errors look like {dtype_name} rounding ({how} {dtype_name}): a relative error"
            f" of {relative:.2g}, in ulps {ulps}",
            fix,
            0.0,
        )
    return None


def split_errors(name: str, sample: Sample, truth: torch.Tensor) -> tuple[float, float] | None:
    """The sample's error on its valid rows, relative to the truth's size, split into what a
    least-squares fit per row on the row's truth, 1 and (for grad_x) xhat explains, and what it
    leaves (None: no finite error to split)."""
    import torch

    problem = sample.problem
    channels = problem.channels
    valid = sample.valid.reshape(-1)
    rows = truth.reshape(-1, channels)[valid]
    error = sample.actual.reshape(-1, channels)[valid].double() - rows
    size = float(rows.norm())
    if not len(rows) or not size > 0 or not bool(error.isfinite().all()):
        return None
    basis = [rows, torch.ones_like(rows)]
    if name == "grad_x":
        x = sample.x.reshape(-1, channels)[valid].double()
        centered = x - x.mean(dim=1, keepdim=True)
        basis.append(centered * (centered.square().mean(dim=1, keepdim=True) + problem.eps).rsqrt())
    design = torch.stack(basis, dim=2)  # [R, C, k]
    coefficients = torch.linalg.lstsq(design, error.unsqueeze(2)).solution
    fitted = (design @ coefficients).squeeze(2)
    return float(fitted.norm()) / size, float((error - fitted).norm()) / size


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def eps_diagnosis(finding: Finding, eps: float, origin: str) -> Diagnosis:
    """The eps RESULT's rows give, as the one explanation of a tensor (``origin``: where the
    reference's eps came from, ``the default`` or ``from --eps``...).

    Example:
        >>> from maskln_cli.verify.systematic import Finding
        >>> found = Finding(717, 5e-4, 4e-6, 0.0, 0.0, 1e-6, True, False, eps=1.02e-5,
        ...                 model="eps")
        >>> d = eps_diagnosis(found, 1e-3, "from --eps")
        >>> d.description
        "RESULT's eps ≈ 1e-05, not the reference's 0.001 (from --eps)"
        >>> for clause in d.fix.split("; "):
        ...     print(clause)
        if RESULT's eps is the right one, give `--eps 1e-05`
        else the kernel's eps is not the model's
    """
    from maskln_cli.op.mistakes import Diagnosis

    if finding.eps is not None:
        found, given = f"≈ {finding.eps:.2g}", f"{finding.eps:.2g}"
    else:
        found, given = f"is at most {finding.eps_at_most:.1g}", "EPS"
    description = f"RESULT's eps {found}, not the reference's {eps:g} ({origin})"
    if origin == "the default":  # probably forgotten: say how to give it
        fix = f"give the model's eps: `--eps {given}` (or `--config`)"
    else:  # given (a dump's metadata, a config): more likely the kernel's is wrong
        fix = (
            f"if RESULT's eps is the right one, give `--eps {given}`; else the kernel's eps is"
            " not the model's"
        )
    return Diagnosis("eps_mismatch", description, fix, 0.0)


def mistake_diagnosis(name: str) -> Diagnosis:
    """The catalogue's mistake ``name``, as its systematic factors named it."""
    from maskln_cli.op.mistakes import MISTAKES, Diagnosis

    mistake = MISTAKES[name]
    return Diagnosis(mistake.name, mistake.description, mistake.fix, 0.0)


def candidate_of(diagnosis: Diagnosis, finding: Finding | None) -> dict[str, Mistake]:
    """An explanation as a formula to try first on later tensors: a mistake of the catalogue,
    or the correct op with the eps RESULT's rows gave. Empty when it has none."""
    from maskln_cli.op.mistakes import MISTAKES, Mistake, correct

    if diagnosis.mistake in MISTAKES:
        return {diagnosis.mistake: MISTAKES[diagnosis.mistake]}
    if diagnosis.mistake == "eps_mismatch" and finding is not None:
        other = finding.eps if finding.eps is not None else 0.0
        return {
            "eps_mismatch": Mistake(
                "eps_mismatch", diagnosis.description, diagnosis.fix,
                lambda x, valid, scale, bias, eps: correct(x, valid, scale, bias, other),
            )
        }  # fmt: skip
    return {}
