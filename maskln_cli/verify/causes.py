"""Which cause a failing tensor of ``maskln verify`` is given, if any: one whose model explains
the evidence, or none.

A cause is named only when its model explains what RESULT shows, all of it
(:meth:`Causes.diagnose`):

- a **forward** mistake (a wrong formula, another eps, a normalization's factor) shows in out:
  when out was checked and is right, it explains no gradient, whatever the gradient's errors
  look like; only the backward's own mistakes (:data:`maskln_cli.op.mistakes.BACKWARD_MISTAKES`)
  and its terms' systematic errors (:mod:`.terms`) may;
- a formula is named when the result is within its match distance and clearly closer to it
  than to any other (:data:`.diagnose.AMBIGUOUS`);
- a coarser dtype's rounding, when the result has its granularity (:mod:`.granularity`), or
  an earlier tensor had it and these errors are its size;
- statistics overflowing a half dtype, when the rows wrong are those whose statistics overflow
  and no other (before NaN from the padding is blamed);
- for a sum over rows (grad_scale, grad_bias), the backward's mistakes evaluated on the whole
  input when it is small enough (:data:`SUM_ELEMENTS`), or an earlier tensor's explanation
  whose systematic factor it shares.

Otherwise no cause is named, and the words say where the error is instead (:func:`where`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from maskln_cli.verify.options import ROW_TENSORS

if TYPE_CHECKING:
    import torch

    from maskln_cli.op.mistakes import Diagnosis, Mistake
    from maskln_cli.verify.plan import Checked, Plan
    from maskln_cli.verify.sample import Sample
    from maskln_cli.verify.systematic import Finding, FitSums

CONSISTENT = 3.0
"""A sum's systematic factor agrees with an earlier tensor's when of the same sign and within
this ratio of it (both average the rows' factors, weighted differently)."""
EXPLAINS = 0.5
"""A cause the rows' factors named is confirmed where the result is at most this share as far
from its formula as from the truth (the formula holds three quarters of the error's energy)."""
SUM_ELEMENTS = 1 << 21
"""Inputs of at most this many elements have their sums' mistakes evaluated (each formula's
gradients over the whole input, in float64); larger ones are explained by their rows."""
CONCENTRATED = 0.9
"""An error is said to be in some channels when they hold this share of its energy."""
FEW = 5
"""Rows (or a sum's elements) are listed where an unexplained error is when it is in at most
this many (the worst rows' table shows them)."""


@dataclasses.dataclass
class Explained:
    """An earlier tensor's explanation: its diagnosis, the formula to try first on later
    tensors, and its systematic factor (None: not systematic)."""

    diagnosis: Diagnosis
    candidates: dict[str, Mistake]
    factor: float | None
    finding: Finding | None = None

    def same_eps(self, found: Finding) -> bool:
        """Whether ``found``'s eps is this explanation's: two values within 20 %, a value
        within a bound, or two bounds (eps too small to resolve, on two tensors' rows)."""
        earlier = self.finding
        if not self.diagnosis.mistake.endswith("eps_mismatch") or earlier is None:
            return False
        mine, theirs = (earlier.eps, earlier.eps_at_most), (found.eps, found.eps_at_most)
        if mine[0] is not None and theirs[0] is not None:
            return abs(mine[0] - theirs[0]) <= 0.2 * max(mine[0], theirs[0])
        if mine[1] is not None and theirs[1] is not None:
            return True
        value, bound = (mine[0], theirs[1]) if mine[0] is not None else (theirs[0], mine[1])
        return value is not None and bound is not None and value <= bound


class Causes:
    """The causes of a plan's failing tensors, explained in the order out, grad_x, grad_scale,
    grad_bias: what earlier tensors showed is evidence for the later ones."""

    def __init__(
        self,
        plan: Plan,
        poisoned: list[int],
        mask: object | None,
        origin: str,
        wrong: Callable[[str], bool | None],
        fits: dict[str, FitSums] | None = None,
    ):
        from maskln_cli.verify.diagnose import catalogue_of

        self.plan = plan
        self.problem = plan.problem
        self.norm = plan.problem.norm.name
        self.catalogue = catalogue_of(plan.problem)  # the norm's known mistakes
        self.result = plan.result
        self.judge = plan.judge
        self.poisoned = poisoned  # invalid rows with NaN or inf in x or grad_out
        self.mask = mask
        self.origin = origin  # where the reference's eps came from, in words
        # Whether a tensor of RESULT is wrong (beyond its budget, or systematic; None: not
        # checked), whichever order it is explained in.
        self.wrong = wrong
        self.fits = fits or {}  # each tensor's systematic-error regressions (out's: its eps)
        self.sampled: tuple[Sample, float] | None = None  # out's diagnosed rows, and noise
        # The current tensor's diagnosed rows and their truth (for where its error is).
        self.current: tuple[Sample, torch.Tensor] | None = None
        self.explained: Explained | None = None  # the first explanation of RESULT's tensors
        self.first: Diagnosis | None = None  # the first diagnosis of RESULT's tensors
        # Whether out's failing rows matched none of the catalogue's formulas: grad_x's then
        # skip them (a backward pass is written from the forward's formula).
        self.no_formula = False
        # Whether an earlier tensor was explained by a formula's mistake: a later one's errors
        # are then not called a coarser dtype's rounding (its size may match by chance).
        self.formula_said = False
        # Whether out was checked and is right (None: not checked), and its diagnosis.
        self.out_right: bool | None = None
        self.out_diagnosis: Diagnosis | None = None

    def evidence(self, checked: Checked) -> str:
        """What may explain ``checked``, given out: ``any`` cause (out itself, or a gradient
        beside an out that was not checked); only the ``backward``'s own mistakes (out was
        checked and is right: a forward mistake would show in it); or only the ``same`` cause
        as out's (out is wrong: the kernel's forward is, and its gradients follow; none when
        out's was not found)."""
        if checked.name == "out" or self.out_right is None:
            return "any"
        return "backward" if self.out_right else "same"

    def said(self, checked: Checked, diagnosis: Diagnosis | None, found: Finding | None) -> None:
        """Remember a tensor's diagnosis as evidence for later ones."""
        if checked.name == "out":
            self.out_diagnosis = diagnosis
        if diagnosis is None:
            return
        if self.first is None:
            self.first = diagnosis
        if not diagnosis.mistake.startswith("rounding_"):
            self.formula_said = True
        if self.explained is None:
            from maskln_cli.verify.diagnose import candidate_of

            candidates = candidate_of(diagnosis, found, self.norm)
            if candidates:
                factor = found.factor if found is not None else None
                self.explained = Explained(diagnosis, candidates, factor, found)

    def diagnose(self, checked: Checked, found: Finding | None) -> Diagnosis | None:
        """The one diagnosis of a failing tensor (None: none found)."""
        from maskln_cli.verify import diagnose, terms
        from maskln_cli.verify.factor_models import MISTAKE_FACTORS

        outcome, comparison = checked.outcome, checked.comparison
        assert outcome is not None and comparison is not None
        self.current = None
        if not self.catalogue.fitted:
            found = None  # the systematic test's models (eps, terms, factors) are LayerNorm's
        evidence = self.evidence(checked)
        if evidence == "same" and self.out_diagnosis is None:
            return None  # out is wrong in no known way: nor are its gradients, known
        if found is not None and checked.name in ROW_TENSORS and overflowed(self, checked):
            found = None  # a factor of rows no statistic holds says nothing of a formula
        if found is not None and found.model == "eps" and checked.name == "grad_bias":
            found = None  # no eps enters grad_bias, a sum of grad_out
        earlier = self.explained
        model = found.model if found is not None else None
        if model in terms.MISSING.values() and evidence != "same":
            return diagnose.mistake_diagnosis(model)  # type: ignore[arg-type]
        if found is not None and model == "eps":
            if earlier is not None and earlier.same_eps(found):
                return earlier.diagnosis  # one eps for RESULT, as the first tensor gave it
            if evidence == "any":
                named = diagnose.eps_diagnosis(found, self.problem.eps, self.origin)
                if confirmed(self, checked, named, found):
                    return named
            # out is right with the reference's eps: the backward's own, if its xhat (and so
            # grad_scale, when checked) is off too, and grad_bias right (no eps is in it)
            backward = self.wrong("grad_scale") is not False and self.wrong("grad_bias") is not True
            if evidence == "backward" and backward and forward_eps_shown(self, found):
                return diagnose.backward_eps_diagnosis(found, self.problem.eps)
        if model in MISTAKE_FACTORS and evidence == "any":
            named = diagnose.mistake_diagnosis(model)  # type: ignore[arg-type]
            if confirmed(self, checked, named, found):
                return named
        nonfinite = bool(outcome.nan_where_finite or outcome.inf_where_finite)
        if checked.name in ROW_TENSORS:
            if comparison.failing_rows:
                found_here = self._rows(checked, found, nonfinite, evidence)
                if found_here is not None:
                    return found_here
        elif self.problem.grad_out is not None:
            found_here = self._sums(checked, nonfinite, evidence)
            if found_here is not None or nonfinite:
                return found_here
        if earlier is not None and found is not None and earlier.factor is not None:
            same = evidence != "same" or earlier.diagnosis is self.out_diagnosis
            ratio = found.factor / earlier.factor if earlier.factor else math.inf
            if same and 1 / CONSISTENT <= ratio <= CONSISTENT:
                return earlier.diagnosis
        return None

    def _rows(
        self, checked: Checked, found: Finding | None, nonfinite: bool, evidence: str
    ) -> Diagnosis | None:
        """out's or grad_x's diagnosis from a sample of its failing rows."""
        from maskln_cli.op import mistakes as catalogue
        from maskln_cli.verify import diagnose

        comparison = checked.comparison
        assert comparison is not None
        sample = diagnose.take_sample(
            self.problem, self.result, checked.key, comparison.failing_rows,
            self.mask,  # type: ignore[arg-type]
        )  # fmt: skip
        judge = checked.judge or self.judge
        truth, guess = sample.reference(checked.name, judge)
        noise = catalogue.relative_distance(guess, truth)
        self.current = (sample, truth)
        if checked.name == "out":
            self.sampled = (sample, noise)
        same = self.out_diagnosis if evidence == "same" else None
        if evidence == "any" or (same is not None and same.mistake == "statistics_overflow"):
            # A kernel keeping float16 statistics may store float32 (or compute in it): a
            # guess, where a formula that explains as much is as likely; and so is a half
            # kernel's keeping its own (torch's keep float32). A float32 or float64 kernel
            # keeps its statistics in its dtype at least.
            own = catalogue.RANGE_OF.get(judge, judge)
            for dtype in dict.fromkeys([judge, catalogue.STATISTICS_OVERFLOW_DTYPE]):
                bias = self.problem.bias if checked.name == "out" else None
                kept = catalogue.RANGE_OF.get(dtype, dtype)
                overflow = catalogue.overflow_match(
                    sample.actual, truth, sample.x, sample.valid, dtype, bias,
                    guessed=kept != own or dtype.itemsize < 4,
                )  # fmt: skip
                if overflow is not None:
                    told = diagnose.overflow_or_formula(
                        overflow, checked.name, sample, judge, noise, evidence == "any"
                    )
                    if told != "formula":
                        return overflow if told == "overflow" else None
                    break
        if nonfinite and checked.name == "grad_x":
            if evidence == "same" or not self._padding_may_leak(checked):
                return None
            return catalogue.diagnose_nan_gradient(
                "grad_x", sample.actual, truth, sample.x, sample.valid, sample.grad_out,
                self.problem.eps,
            )  # fmt: skip
        earlier = self.explained
        candidates = earlier.candidates if earlier is not None else None
        if evidence == "same":
            assert same is not None
            candidates = diagnose.candidate_of(same, self._finding_of(same), self.norm)
        elif (
            evidence == "backward"
            and earlier is not None
            and (earlier.diagnosis.mistake not in self.catalogue.backward)
        ):
            candidates = None
        first = self.first.mistake if self.first is not None else ""
        rounded = first.removeprefix("rounding_") if first.startswith("rounding_") else None
        found_here = diagnose.diagnose_rows(
            checked.name, sample, judge, truth, noise, candidates,
            (found is not None and found.rounding_excluded) or self.formula_said,
            catalogue=not self.no_formula and evidence != "same",
            confirmed=rounded, forward=evidence == "any",
        )  # fmt: skip
        if checked.name == "out":
            self.no_formula = found_here is None or found_here.mistake.startswith("rounding")
        if evidence == "same" and found_here is not None and same is not None:
            return same if found_here.mistake == same.mistake else None
        return found_here

    def _padding_may_leak(self, checked: Checked) -> bool:
        """Whether NaN or inf in ``checked`` may come from the padding (verify cannot call the
        kernel again on clean padding, as grade does): a kernel's rows are its own, so grad_x
        must be non-finite on its padding rows, not only on valid rows (an overflow of their
        own: NaN there says nothing of the padding, whatever it holds). A sum (grad_scale,
        grad_bias) adds up the valid rows' terms too: when grad_x is non-finite on valid rows
        and right on the padding's, those are what its NaN comes from."""
        grad_x = checked if checked.name == "grad_x" else next(
            (c for c in self.plan.checked if c.name == "grad_x"), None
        )  # fmt: skip
        if grad_x is None or grad_x.comparison is None or grad_x.outcome is None:
            return checked.name != "grad_x"
        outcome = grad_x.outcome
        nonfinite = (outcome.nan_where_finite or 0) + (outcome.inf_where_finite or 0)
        in_padding = grad_x.comparison.nonfinite_in_invalid_rows
        return in_padding > 0 or (checked.name != "grad_x" and nonfinite == 0)

    def _finding_of(self, diagnosis: Diagnosis) -> Finding | None:
        earlier = self.explained
        return earlier.finding if earlier is not None and earlier.diagnosis is diagnosis else None

    def _sums(self, checked: Checked, nonfinite: bool, evidence: str) -> Diagnosis | None:
        """grad_scale's or grad_bias's diagnosis: non-finite values (out's overflow, else NaN
        from the padding), or a mistake over the whole input (out's own, when out is wrong;
        the backward's, when it is right)."""
        import torch

        from maskln_cli.op import mistakes as catalogue
        from maskln_cli.verify.diagnose import candidate_of

        problem = self.problem
        assert problem.grad_out is not None
        same = self.out_diagnosis if evidence == "same" else None
        if nonfinite:
            if same is not None and same.mistake == "statistics_overflow":
                return same
            if evidence == "same" or not self._padding_may_leak(checked):
                return None
            index = torch.tensor(self.poisoned, dtype=torch.long)
            reference = torch.zeros(problem.channels, dtype=torch.float64)
            return catalogue.diagnose_nan_gradient(
                checked.name, self.result.tensor(checked.key), reference, problem.x[index],
                problem.valid[index], problem.grad_out[index], problem.eps,
            )  # fmt: skip
        if problem.rows * problem.channels > SUM_ELEMENTS:
            return None
        outcome = checked.outcome
        assert outcome is not None
        if same is not None:
            tried = candidate_of(same, self._finding_of(same), self.norm)
            if not tried:
                return None
        elif evidence == "backward":
            tried = dict(self.catalogue.backward)
        else:
            tried = {**self.catalogue.mistakes, **self.catalogue.backward}
        judge = checked.judge or self.judge
        found = catalogue.diagnose_gradient(
            self.result.tensor(checked.key), problem.x, problem.valid, problem.scale,
            problem.bias, problem.grad_out, problem.eps, judge,
            noise=outcome.yardstick_rel_l2, mistakes=tried, name=checked.name, norm=self.norm,
        )  # fmt: skip
        if found and (len(found) == 1 or found[1].distance > 3 * found[0].distance):
            return same if same is not None else found[0]
        return None


def confirmed(causes: Causes, checked: Checked, named: Diagnosis, found: Finding) -> bool:
    """Whether the formula of a cause the rows' factors named (another eps, a mistake of
    the normalization) explains out or grad_x on a sample of the failing rows element by
    element, most of the error (the result at most :data:`EXPLAINS` as far from it as
    from the truth): a common factor per row is no proof (scale missing on rows of two
    values, every |xhat| 1, scales each row alike, and was named "RESULT's eps is about
    11"). The rounding of a half dtype or of nearly constant rows may keep the result
    from matching the formula closely; the rows' factors have told it from rounding."""
    from maskln_cli.op import mistakes as catalogue
    from maskln_cli.verify import diagnose

    comparison = checked.comparison
    if checked.name not in ROW_TENSORS or comparison is None or not comparison.failing_rows:
        return True  # a sum's elements: no formula of rows to try
    formula = diagnose.candidate_of(named, found, causes.norm)
    if not formula:
        return True
    sample = diagnose.take_sample(
        causes.problem, causes.result, checked.key, comparison.failing_rows,
        causes.mask,  # type: ignore[arg-type]
    )  # fmt: skip
    # Its valid rows only: what the padding holds is another question (a padding of
    # ones beside another eps: the eps is the cause of the values)
    import torch

    padding = ~sample.valid.unsqueeze(-1)
    zeros = torch.zeros((), dtype=sample.actual.dtype)
    sample = dataclasses.replace(sample, actual=torch.where(padding, zeros, sample.actual))
    (mistake,) = formula.values()
    problem = causes.problem
    grad_out = sample.grad_out if checked.name == "grad_x" else None
    to_formula, to_truth = catalogue.distances(
        sample.actual, sample.x, sample.valid, problem.scale, problem.bias, problem.eps,
        mistake, grad_out, causes.norm,
    )  # fmt: skip
    return to_formula <= EXPLAINS * to_truth


def overflowed(causes: Causes, checked: Checked) -> bool:
    """Whether a failing row of ``checked`` has a mean square beyond the judged dtype's
    range: every statistic a kernel keeps in it overflows there, a correct formula's and
    a wrong one's alike (a float32 two-pass kernel on rows of 1e25 gives their bias, as
    sqrt missing does), and only the rows tell the overflow from the rest."""
    import torch

    from maskln_cli.op.backward_mistakes import overflowing_rows

    comparison = checked.comparison
    if comparison is None or not comparison.failing_rows:
        return False
    channels = causes.problem.channels
    index = torch.tensor(comparison.failing_rows, dtype=torch.long)
    rows = causes.problem.x.reshape(-1, channels)[index].double() / math.sqrt(channels)
    judge = checked.judge or causes.judge
    return bool(overflowing_rows(rows, causes.problem.valid.reshape(-1)[index], judge).any())


def where(
    checked: Checked,
    problem_valid: torch.Tensor,
    leading: tuple[int, ...],
    current: tuple[Sample, torch.Tensor] | None,
) -> str:
    """Where a failing tensor's error is, in words, for one no cause explains: which rows
    (their index in x's ``leading`` shape, when not every valid row), which channels (when a
    few hold it: ``CONCENTRATED``), from the rows diagnosed (``current``: their sample and
    truth)."""
    comparison, outcome = checked.comparison, checked.outcome
    assert comparison is not None and outcome is not None
    parts = []
    if checked.name in ROW_TENSORS:
        rows = [r for r in comparison.failing_rows if bool(problem_valid[r])]
        if rows and len(rows) <= FEW:
            shown = ", ".join(str(leading_index(r, leading)) for r in rows)
            parts.append(f"{'row' if len(rows) == 1 else 'rows'} {shown}")
        channels = _channels(*current) if current is not None else None
        if channels:
            parts.append(channels)
    elif 0 < comparison.beyond <= FEW:  # a sum's elements are its channels
        elements = sorted({w.index[-1] for w in outcome.worst})
        if len(elements) == comparison.beyond:
            shown = ", ".join(str(e) for e in elements)
            parts.append(f"{'element' if len(elements) == 1 else 'elements'} {shown}")
    return "not one of the known mistakes" + (f": {', '.join(parts)}" if parts else "")


def leading_index(row: int, leading: tuple[int, ...]) -> list[int]:
    """A flat row's index in x's leading shape: ``[7, 99]``."""
    index = []
    for size in reversed(leading):
        row, position = divmod(row, max(size, 1))
        index.append(position)
    return index[::-1]


def _channels(sample: Sample, truth: torch.Tensor) -> str | None:
    """The channels holding the error of the rows diagnosed, when a few hold most of it."""
    import torch

    channels = truth.shape[-1]
    valid = sample.valid.reshape(-1)
    error = (sample.actual.double() - truth).reshape(-1, channels)[valid]
    energy = error.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).square().sum(dim=0)
    total = float(energy.sum())
    if not total > 0 or channels < 4:
        return None
    order = torch.argsort(energy, descending=True)
    share = energy[order].cumsum(dim=0) / total
    count = int((share < CONCENTRATED).sum()) + 1
    if count > min(8, channels // 2):
        return None
    shown = ", ".join(str(int(c)) for c in order[:count].sort().values)
    return f"{'channel' if count == 1 else 'channels'} {shown} (of {channels})"


def forward_eps_shown(causes: Causes, found: Finding) -> bool:
    """Whether out's rows show that the forward used the reference's eps, not ``found``'s (a
    gradient's): out's pooled factor is :data:`~maskln_cli.verify.diagnose.AMBIGUOUS` times
    nearer 0 than to the factor ``found``'s eps gives those rows, and that factor is
    :data:`~maskln_cli.verify.systematic.SYSTEMATIC_Z` standard errors from it. Out passing is
    not enough: on rows at an offset of 1e3 a forward eps of 0 moves out by 5e-6 of itself,
    far inside its budget, and a kernel whose one eps is wrong in both passes was told its
    backward took another eps than its forward."""
    import torch

    from maskln_cli.verify.diagnose import AMBIGUOUS
    from maskln_cli.verify.systematic import SYSTEMATIC_Z

    fit = causes.fits.get("out")
    other = found.eps if found.eps is not None else found.eps_at_most
    if fit is None or not fit.kept or other is None:
        return False
    f, spread, w = torch.cat(fit.kept).double()[:, :3].unbind(dim=1)
    total = float(w.sum())
    if not total > 0:
        return False
    eps = causes.problem.eps
    predicted = (spread / (spread - eps + other).clamp_min(1e-300)).sqrt() - 1
    observed = float((w * f).sum()) / total
    expected = float((w * predicted).sum()) / total
    error = math.sqrt(float((w.square() * (f - observed).square()).sum())) / total
    apart = abs(observed - expected)
    return apart > SYSTEMATIC_Z * error and abs(observed) * AMBIGUOUS < apart
