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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from maskln_cli.files.masks import RowMask
    from maskln_cli.files.problem import Problem
    from maskln_cli.files.tensorfile import TensorFile
    from maskln_cli.op.mistake_records import Catalogue
    from maskln_cli.op.mistakes import Diagnosis, Mistake
    from maskln_cli.verify.systematic import Finding

from maskln_cli.verify.sample import Sample

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


def catalogue_of(problem: Problem) -> Catalogue:
    """The known mistakes of ``problem``'s norm (LayerNorm's or RMSNorm's)."""
    from maskln_cli.op.mistakes import CATALOGUES

    return CATALOGUES[problem.norm.name]


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
        index = torch.tensor(_with_context(problem.valid, rows, budget), dtype=torch.long)
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


CONTEXT_ROWS = 4
"""Rows RESULT got right, of each kind (valid, invalid), that a sample of failing rows alone
also holds: a formula must give them too. Without them, one valid row zeroed at C = 4,096
matched "the mask read the other way round" (which zeroes the valid rows, and which the
right invalid rows refute), and one padding row normalized "invalid rows return bias"."""


def _with_context(valid: torch.Tensor, rows: Sequence[int], budget: int) -> list[int]:
    """The failing ``rows`` (flat row indices, at most ``budget`` in all), and up to
    :data:`CONTEXT_ROWS` other rows of each kind (``valid``: over the flat rows), in order."""
    import torch

    failing = list(dict.fromkeys(rows))
    context: list[int] = []
    taken = set(failing[:budget])
    for kind in (valid, ~valid):
        candidates = torch.nonzero(kind.reshape(-1)).reshape(-1)[: len(taken) + CONTEXT_ROWS]
        context += [r for r in candidates.tolist() if r not in taken][:CONTEXT_ROWS]
    kept = failing[: max(1, budget - len(context))]
    return sorted(kept + context[: max(0, budget - len(kept))])


def diagnose_rows(
    name: str,
    sample: Sample,
    judge: torch.dtype,
    truth: torch.Tensor,
    noise: float,
    candidates: dict[str, Mistake] | None = None,
    systematic: bool = False,
    catalogue: bool = True,
    confirmed: str | None = None,
    forward: bool = True,
) -> Diagnosis | None:
    """The mistake out or grad_x (``name``) on ``sample`` matches best: the statistics of a
    half dtype overflowing (the rows wrong are those, and only those); among ``candidates``
    (an earlier tensor's explanation, tried alone: one formula, not the catalogue), then the
    catalogue's formulas (for grad_x, the forward's only when ``forward``: a forward mistake
    shows in out, and out was right), named only when clearly the best (:data:`AMBIGUOUS`);
    then the rounding of a coarser dtype (unless the tensor's error is ``systematic``, which
    rounding is not, or an earlier tensor's was a formula's: the caller says so; without
    ``catalogue``, its formulas are not tried; ``confirmed``, see
    :func:`precision_diagnosis`, whose model is LayerNorm's: not tried for RMSNorm). ``truth``
    is the sample's float64 truth, ``noise`` PyTorch's relative distance from it in
    ``judge``; the formulas are those of the problem's norm."""
    from maskln_cli.op import mistakes as formulas

    problem = sample.problem
    known = catalogue_of(problem)
    overflow = formulas.overflow_match(sample.actual, truth, sample.x, sample.valid, judge)
    if overflow is not None:
        told = overflow_or_formula(overflow, name, sample, judge, noise, forward)
        if told != "formula":
            return overflow if told == "overflow" else None
    default = None if forward else known.backward
    tries = ([candidates] if candidates else []) + ([default] if catalogue else [])
    for mistakes in tries:
        found = formula_matches(name, sample, judge, noise, mistakes)
        if found:
            # (a tie at distance 0 is no margin: two formulas giving the same result)
            clear = len(found) == 1 or found[1].distance > AMBIGUOUS * found[0].distance
            if clear and one_value_rival(found[0], sample, judge):
                return None
            return found[0] if clear else None
    if systematic or not known.fitted:
        return None
    return precision_diagnosis(name, sample, truth, confirmed)


AMBIGUOUS = 3.0
"""A formula is named only when the result is this many times closer to it than to the next
formula that matches: else the evidence does not tell them apart, and none is named."""

ONE_VALUE_RIVALS = {
    # NaN: a 0/0 without eps, or inf - inf from an accumulator that overflows (64 values of
    # 1e4 sum beyond float16's 65,504), where one would: the kernel's dtype's, or a half
    # kernel's float16 one (a float32 or float64 kernel keeps its own).
    "eps_missing": "overflow",
    # xhat = 1 (the row's sign): the mean left out, or a mean off by anything at all (a
    # bfloat16 accumulator's rounding of a row of 1e4).
    "rms_norm": "always",
}
"""Formulas that rows of one value (in x as given: their normalized part 0) do not tell from
another cause, and when: such rows alone name none of them."""


def one_value_rival(found: Diagnosis, sample: Sample, judge: torch.dtype) -> bool:
    """Whether the sample's valid rows are all of one value and :data:`ONE_VALUE_RIVALS`
    has a cause explaining them as well as ``found`` does."""
    import torch

    from maskln_cli.op.backward_mistakes import overflowing_rows

    rival = ONE_VALUE_RIVALS.get(found.mistake)
    if rival is None:
        return False
    channels = sample.x.shape[-1]
    valid = sample.valid.reshape(-1)
    rows = sample.x.reshape(-1, channels)[valid]
    if not len(rows):
        return False
    low, high = rows.aminmax(dim=1)
    if not bool((low == high).all()):
        return False
    if rival == "always":
        return True
    accumulators = {judge, torch.float16} if judge.itemsize < 4 else {judge}
    return any(
        bool(overflowing_rows(sample.x, sample.valid, dtype)[valid].all()) for dtype in accumulators
    )


def formula_matches(
    name: str,
    sample: Sample,
    judge: torch.dtype,
    noise: float,
    mistakes: dict[str, Mistake] | None,
) -> list[Diagnosis]:
    """The formulas of ``mistakes`` (None: the catalogue's) that out or grad_x (``name``) on
    ``sample`` matches, best first."""
    from maskln_cli.op import mistakes as formulas

    problem = sample.problem
    args = (sample.x, sample.valid, problem.scale, problem.bias)
    norm = problem.norm.name
    if name == "out":
        return formulas.diagnose_output(
            sample.actual, *args, problem.eps, judge, noise=noise, mistakes=mistakes, norm=norm
        )
    assert sample.grad_out is not None
    return formulas.diagnose_gradient(
        sample.actual, *args, sample.grad_out, problem.eps, judge, noise=noise,
        mistakes=mistakes, norm=norm,
    )  # fmt: skip


def overflow_or_formula(
    overflow: Diagnosis,
    name: str,
    sample: Sample,
    judge: torch.dtype,
    noise: float,
    forward: bool = True,
) -> str:
    """Which explains out or grad_x (``name``) on ``sample`` better: the statistics
    ``overflow`` that matched it (``"overflow"``), a formula of the catalogue clearly closer
    to it (``"formula"``: the caller names it), or neither by :data:`AMBIGUOUS`'s margin
    (``"neither"``): sqrt missing leaves rows of a large variance near their bias as a zero
    rstd does. An overflow at distance 0 (every statistic of its rows overflows the kernel's
    dtype) has no rival; the formulas are the forward's only when ``forward``."""
    if overflow.distance == 0.0:
        return "overflow"
    known = catalogue_of(sample.problem)
    found = formula_matches(name, sample, judge, noise, None if forward else known.backward)
    if not found or found[0].distance >= AMBIGUOUS * overflow.distance:
        return "overflow"
    return "formula" if found[0].distance * AMBIGUOUS <= overflow.distance else "neither"


def precision_diagnosis(
    name: str, sample: Sample, truth: torch.Tensor, confirmed: str | None = None
) -> Diagnosis | None:
    """Errors of a kernel that rounds to a coarser dtype, and no formula's: the dtype of
    :data:`PRECISIONS` (coarser than the result's) whose granularity the result has
    (:mod:`.granularity`: what the kernel computed lies on the dtype's grid), which a formula
    mistake's errors, of the same size, do not have. ``confirmed``: a dtype whose granularity
    an earlier tensor of RESULT had (out's, for grad_x, whose autograd through a kernel's
    casts leaves no grid of its own): then errors of that dtype's rounding's size
    (:data:`ACCUMULATED`, :data:`STORED`) are enough.

    Each valid row's error is split (:func:`split_errors`) into what its statistics' rounding
    makes (a factor along the row's truth, a shift, and for grad_x a part along xhat: each
    row's own) and what is left element by element: errors mostly of the first kind come from
    sums over a row accumulated in the coarse dtype, those of the second from values rounded
    to it on the way. The description gives their size in ulps of each dtype."""
    import torch

    from maskln_cli.op.mistakes import Diagnosis
    from maskln_cli.verify.granularity import coarsest

    split = split_errors(name, sample, truth)
    if split is None:
        return None
    structured, elementwise = split
    stored = torch.finfo(sample.actual.dtype).eps
    coarser = [getattr(torch, d) for d in PRECISIONS]
    coarser = [d for d in coarser if torch.finfo(d).eps > stored]
    if confirmed is not None:
        dtype = getattr(torch, confirmed)
        if dtype not in coarser or not _rounding_sized(structured, elementwise, dtype, sample):
            return None
    else:
        dtype = coarsest(name, sample, truth, coarser)
    if dtype is None:
        return None
    dtype_name = str(dtype).removeprefix("torch.")
    relative = math.hypot(structured, elementwise)
    ulps = ", ".join(
        f"{relative / torch.finfo(getattr(torch, d)).eps:,.2g} of {d}" for d in PRECISIONS
    )
    if structured >= elementwise:
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


def _rounding_sized(
    structured: float, elementwise: float, dtype: torch.dtype, sample: Sample
) -> bool:
    """Whether errors split so are the size of ``dtype``'s rounding: of sums accumulated in it
    (mostly in each row's statistics) or of values rounded to it (element by element)."""
    from maskln_cli.verify.budget import unit_roundoff

    u = unit_roundoff(dtype)
    if structured >= elementwise:
        low, high = ACCUMULATED[0] * u, ACCUMULATED[1] * sample.problem.channels * u
        return low <= structured <= high
    return STORED[0] * u <= elementwise <= STORED[1] * u


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
    reference's eps came from, ``the default`` or ``from --eps``...), each eps printed with as
    many digits as it takes to tell them apart (:func:`distinct`).

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
        value, reference = distinct(finding.eps, eps)
        found, given = f"≈ {value}", value
    else:
        found, given = f"is at most {finding.eps_at_most:.1g}", "EPS"
        reference = f"{eps:g}"
    description = f"RESULT's eps {found}, not the reference's {reference} ({origin})"
    if origin == "the default":  # probably forgotten: say how to give it
        fix = f"give the model's eps: `--eps {given}` (or `--config`)"
    else:  # given (a dump's metadata, a config): more likely the kernel's is wrong
        fix = (
            f"if RESULT's eps is the right one, give `--eps {given}`; else the kernel's eps is"
            " not the model's"
        )
    return Diagnosis("eps_mismatch", description, fix, 0.0)


def backward_eps_diagnosis(finding: Finding, eps: float) -> Diagnosis:
    """The eps a gradient's rows give when out is right with the reference's: the backward
    uses another eps than the forward.

    Example:
        >>> from maskln_cli.verify.systematic import Finding
        >>> found = Finding(90, 4.5e-6, 1e-8, 0.0, 0.0, 1e-6, True, False, eps=9.9e-7,
        ...                 model="eps")
        >>> backward_eps_diagnosis(found, 1e-5).description
        "the backward's eps ≈ 9.9e-07, not the forward's 1e-05 (out is right): another eps in the backward"
    """  # noqa: E501
    from maskln_cli.op.mistakes import Diagnosis

    if finding.eps is not None:
        value, reference = distinct(finding.eps, eps)
        found = f"≈ {value}"
    else:
        found, reference = f"is at most {finding.eps_at_most:.1g}", f"{eps:g}"
    return Diagnosis(
        "backward_eps_mismatch",
        f"the backward's eps {found}, not the forward's {reference} (out is right): another"
        " eps in the backward",
        "use the forward's eps in the backward (or save the forward's rstd and use it)",
        0.0,
    )


def distinct(value: float, reference: float) -> tuple[str, str]:
    """``value`` and ``reference`` printed with as many significant digits as it takes to tell
    them apart (2 at least; ``reference`` as it is when ``:g`` prints it exactly).

    Example:
        >>> distinct(1.02e-5, 1e-5)
        ('1.02e-05', '1e-05')
        >>> distinct(9.99999974737875e-06, 1e-5)
        ('9.9999997e-06', '1e-05')
        >>> distinct(1.2e-5, 1e-5)
        ('1.2e-05', '1e-05')
    """
    for digits in range(2, 18):
        a, b = f"{value:.{digits}g}", f"{reference:.{digits}g}"
        if a != b:
            plain = f"{reference:g}"
            return a, plain if float(plain) == reference else b
    return repr(value), repr(reference)


def mistake_diagnosis(name: str) -> Diagnosis:
    """The catalogue's mistake ``name``, as its systematic factors (or its backward's terms)
    named it."""
    from maskln_cli.op.mistakes import BACKWARD_MISTAKES, MISTAKES, Diagnosis

    mistake = MISTAKES.get(name) or BACKWARD_MISTAKES[name]
    return Diagnosis(mistake.name, mistake.description, mistake.fix, 0.0)


def candidate_of(
    diagnosis: Diagnosis, finding: Finding | None, norm: str = "layer"
) -> dict[str, Mistake]:
    """An explanation as a formula to try first on later tensors: a mistake of the ``norm``'s
    catalogue, or the correct op with the eps RESULT's rows gave (in its backward only, when
    out is right). Empty when it has none."""
    from maskln_cli.op.mistakes import CATALOGUES, Mistake

    catalogue = CATALOGUES[norm]
    correct = catalogue.correct
    known = {**catalogue.mistakes, **catalogue.backward}
    if diagnosis.mistake in known:
        return {diagnosis.mistake: known[diagnosis.mistake]}
    if diagnosis.mistake == "eps_mismatch" and finding is not None:
        other = finding.eps if finding.eps is not None else 0.0
        return {
            "eps_mismatch": Mistake(
                "eps_mismatch", diagnosis.description, diagnosis.fix,
                lambda x, valid, scale, bias, eps: correct(x, valid, scale, bias, other),
            )
        }  # fmt: skip
    if diagnosis.mistake == "backward_eps_mismatch" and finding is not None:
        from maskln_cli.op.backward_mistakes import backward_with_eps

        other = finding.eps if finding.eps is not None else 0.0
        return {
            diagnosis.mistake: Mistake(
                diagnosis.mistake, diagnosis.description, diagnosis.fix, correct,
                backward_with_eps(other),
            )
        }  # fmt: skip
    return {}
