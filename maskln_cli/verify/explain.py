"""What is wrong with a failing tensor of ``maskln verify``, in words, and which mistake it is.

After the streaming pass each compared tensor has its figures; :class:`Explainer` replaces the
generic problem lines of a failing one with what is wrong (non-finite values, the padding, the
valid rows: all of them or some, uniformly or not, or the elements of a sum), and diagnoses it:
the known wrong formulas of :mod:`maskln_cli.op.mistakes` are evaluated on a bounded sample of
its failing rows, re-read from INPUT and RESULT, and the one RESULT matches is named.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from maskln_cli.compare.data import times
from maskln_cli.verify.options import ROW_TENSORS

if TYPE_CHECKING:
    import torch

    from maskln_cli.compare.comparison import Comparison
    from maskln_cli.compare.data import TensorComparison
    from maskln_cli.files.masks import RowMask
    from maskln_cli.files.problem import Problem
    from maskln_cli.op.mistakes import Diagnosis
    from maskln_cli.verify.plan import Checked, Plan
    from maskln_cli.verify.systematic import Finding, FitSums

DIAGNOSIS_ELEMENTS = 1 << 21
"""At most this many elements of failing rows are re-read for a diagnosis."""
UNIFORM_SPREAD = 0.3
"""Rows are off "uniformly" when their relative errors' spread is below this share of their
mean (and the mean is well above rounding): the signature of a formula mistake."""


class Explainer:
    """The words and the diagnosis of a plan's failing tensors, once they are measured."""

    def __init__(
        self,
        plan: Plan,
        poisoned: list[int],
        fit: FitSums | None = None,
        mask: RowMask | None = None,
    ) -> None:
        import torch

        self.plan = plan
        self.problem = plan.problem
        self.result = plan.result
        self.verify = plan.verify
        self.mode = plan.mode
        self.judge = plan.judge
        self.valid_rows = plan.valid_rows
        self.poisoned = poisoned  # invalid rows with NaN or inf in x or grad_out
        self.fit = fit  # out's systematic-error regressions (see .systematic)
        self.mask = mask
        self._sampled: tuple[_Sample, float] | None = None  # a diagnosis's rows, and noise
        self._finding: str | None = None  # the systematic error of out, in words
        self._finds_eps = False  # whether it names the eps RESULT used
        self.torch = torch

    # --- words ----------------------------------------------------------------------------

    def describe(self, checked: Checked) -> None:
        """Replace the generic problem lines of a failing tensor with what is wrong, in words,
        then diagnose it."""
        outcome = checked.outcome
        comparison = checked.comparison
        assert outcome is not None and comparison is not None
        structural = [p for p in outcome.problems if p.startswith(("shape", "dtype"))]
        if outcome.numel is None:  # values not compared
            return
        words = self._words(checked.name, outcome, comparison)
        if self.verify.strict and outcome.negative_zeros:
            words.append(
                f"-0.0 at {outcome.negative_zeros:,} padded positions (+0.0 expected; --strict)"
            )
        finding = self._systematic(checked)
        self._finding, self._finds_eps = None, False
        if finding is not None:
            outcome.systematic = finding.to_dict()
            self._finding = finding.sentence(self.problem.eps, self._eps_origin())
            self._finds_eps = finding.eps is not None or finding.eps_at_most is not None
            generic = any(GENERIC in word for word in words)
            if not generic and not self.verify.allow_systematic:
                words.append(self._finding)
        outcome.problems = structural + words
        outcome.passed = not outcome.problems
        if self.mode == "budget":
            # None when no factor would do: NaN or inf, or padding not zeroed.
            fixable = not (outcome.nan_mismatched or outcome.inf_mismatched) and (
                outcome.invalid_rows_zero is not False
            )
            outcome.factor_needed = comparison.factor_needed() if fixable else None
        if not outcome.passed:
            self._diagnose(checked)
            self._findings(checked)

    def _eps_origin(self) -> str:
        source = self.problem.eps_source
        return "the default" if source == "default" else f"from {source}"

    def _systematic(self, checked: Checked) -> Finding | None:
        """out's systematic error (a factor or shift on every valid row), when one is found."""
        from maskln_cli.verify import systematic

        if checked.name != "out" or self.fit is None or self.mode != "budget":
            return None
        precision = self.plan.precisions[checked.judge or self.judge]
        problem = self.problem
        scale, bias = (float(t.square().mean().sqrt()) for t in (problem.scale, problem.bias))
        finding = systematic.pooled(self.fit, precision, problem.eps, scale, bias)
        if finding is not None and systematic.ALWAYS_REPORT and not finding.systematic:
            checked.outcome.systematic = finding.to_dict()  # type: ignore[union-attr]
        return finding if finding is not None and finding.systematic else None

    def _findings(self, checked: Checked) -> None:
        """What kind of wrong, beyond the catalogue (see :mod:`.findings`), said first: a
        coarser kernel's values widened, a wrong --module, a model's own padding; else the
        diagnosis replaces the generic "a formula or eps mistake"."""
        from maskln_cli.verify import findings

        outcome = checked.outcome
        assert outcome is not None and outcome.dtype is not None
        specific: list[str] = []
        if self.verify.dtype == "auto":
            coarser = findings.exact_in_coarser_dtype(
                self.result.tensor(checked.key), outcome.dtype
            )
            if coarser is not None:
                specific.append(
                    f"every value is exactly a {coarser}, stored as {outcome.dtype}: a"
                    f" {coarser} kernel judged by {outcome.dtype}'s budget; --dtype {coarser}"
                    " judges it as one"
                )
        options = self.plan.options
        if checked.name == "out" and options.module and options.params and self._sampled:
            sample, noise = self._sampled
            module = findings.other_module(
                self.problem, options.params, options.module, sample.actual, sample.x,
                sample.valid, noise,
            )  # fmt: skip
            if module is not None:
                specific.append(
                    f"RESULT matches the reference computed with the weights of {module!r},"
                    f" not {options.module!r}: --module {module}?"
                )
        if checked.name == "out" and outcome.mismatched_invalid_rows:
            comparison = checked.comparison
            assert comparison is not None
            valid = self.problem.valid
            rows = [r for r in comparison.failing_rows if not bool(valid[r])]
            if findings.plain_padding(self.problem, self.result, checked.key, rows):
                specific.append(
                    "the invalid rows hold a plain LayerNorm of x (a model's own"
                    " nn.LayerNorm output?): --plain-layer-norm compares the valid rows only"
                )
        if specific:
            for text in specific:
                _replace_generic(outcome.problems, text)
            outcome.problems = specific + [p for p in outcome.problems if p not in specific]
        elif self._finding is not None and self._finds_eps:
            # The eps RESULT used, and the option to give: more than a catalogue's "eps
            # missing" (BERT's 1e-12 reads as none) or "eps 1e-3 instead of 1e-5".
            _replace_generic(outcome.problems, self._finding)
        elif outcome.diagnosis:
            _replace_generic(outcome.problems, str(outcome.diagnosis[0]["description"]))
        elif self._finding is not None:
            _replace_generic(outcome.problems, self._finding)

    def _words(self, name: str, outcome: TensorComparison, comparison: Comparison) -> list[str]:
        """What is wrong with a tensor, in words: non-finite values, the padding, the valid
        rows (all of them or some, uniformly or not), or the elements of a sum."""
        words: list[str] = []
        numel = outcome.numel or 0
        allowed = "budget" if self.mode == "budget" else "tolerance"
        invalid_total = self.problem.rows - self.valid_rows
        bad_invalid = outcome.mismatched_invalid_rows or 0
        bad_valid = (outcome.mismatched_rows or 0) - bad_invalid
        nonfinite = (outcome.nan_where_finite or 0) + (outcome.inf_where_finite or 0)
        # Non-finite values confined to the padding say what is wrong there on their own.
        padding_said = (
            nonfinite > 0
            and nonfinite == comparison.nonfinite_in_invalid_rows
            and comparison.beyond_in_invalid_rows == 0
        )
        where = ""
        if padding_said:
            where = (
                f", all in the {invalid_total:,} invalid rows"
                if bad_invalid == invalid_total
                else f", all in invalid rows ({bad_invalid:,} of {invalid_total:,})"
            ) + ": padding not zeroed"
        for kind, count in (("NaN", outcome.nan_where_finite), ("inf", outcome.inf_where_finite)):
            if count:
                words.append(
                    f"{kind} where the reference is finite at {count:,} of {numel:,}"
                    f" elements{where}"
                )
        reference_nan = (outcome.nan_mismatched or 0) - (outcome.nan_where_finite or 0)
        if reference_nan:
            words.append(
                f"a number where the reference is NaN at {reference_nan:,} elements (a valid"
                " row of x holding NaN or inf gives NaN)"
            )
        ratio = outcome.budget_ratio or 0.0
        worst = f" (worst {times(ratio)} what is allowed)" if 1 < ratio < math.inf else ""
        if name not in ROW_TENSORS:
            if comparison.beyond:
                words.append(
                    f"{comparison.beyond:,} of {numel:,} elements beyond the {allowed}{worst}"
                )
            return words
        if bad_invalid and not padding_said:
            if not bad_valid:
                scope = (
                    f"the {invalid_total:,} invalid rows"
                    if bad_invalid == invalid_total
                    else f"invalid rows ({bad_invalid:,} of {invalid_total:,})"
                )
                words.append(f"only {scope} differ: padding not zeroed")
            else:
                words.append(f"{bad_invalid:,} of {invalid_total:,} invalid rows not zeroed")
        beyond_valid = comparison.beyond - comparison.beyond_in_invalid_rows
        if bad_valid and beyond_valid:
            errors = outcome.row_rel_error
            uniform = self._uniform(outcome, comparison)
            if bad_valid == self.valid_rows and errors is not None:
                shape = (
                    "uniform: a formula or eps mistake" if uniform else "varying from row to row"
                )
                words.append(
                    f"all {self.valid_rows:,} valid rows off; relative error"
                    f" {errors.mean:.2g} ± {errors.std:.1g} ({shape})"
                )
            else:
                text = (
                    f"{beyond_valid:,} elements in {bad_valid:,} of {self.valid_rows:,} valid"
                    f" rows beyond the {allowed}{worst}"
                )
                if uniform and errors is not None:
                    text += (
                        f"; yet every valid row is off by about the same (relative error"
                        f" {errors.mean:.2g} ± {errors.std:.1g} in all {errors.rows:,}):"
                        " a formula or eps mistake"
                    )
                words.append(text)
        return words

    def _uniform(self, outcome: TensorComparison, comparison: Comparison) -> bool:
        """Every valid row off by about the same relative error, well above rounding."""
        errors = outcome.row_rel_error
        if errors is None or errors.rows < 2 or errors.rows < self.valid_rows or errors.mean <= 0:
            return False
        noise = comparison.yardstick_row_error_sum / errors.rows
        return errors.std <= UNIFORM_SPREAD * errors.mean and errors.mean >= 3 * noise

    # --- diagnosis ------------------------------------------------------------------------

    def _diagnose(self, checked: Checked) -> None:
        """Name the known mistake RESULT's tensor matches, from a bounded sample of its failing
        rows (or, for grad_scale and grad_bias, the padding rows holding NaN or inf)."""
        from maskln_cli.op import mistakes as diagnosis

        outcome, comparison = checked.outcome, checked.comparison
        assert outcome is not None and comparison is not None
        problem = self.problem
        nonfinite = bool(outcome.nan_where_finite or outcome.inf_where_finite)
        found: list[diagnosis.Diagnosis] = []
        if checked.name in ROW_TENSORS and comparison.failing_rows:
            sample = self._sample(checked, comparison.failing_rows)
            judge = checked.judge or self.judge
            truth, guess = sample.reference(checked.name, judge)
            noise = diagnosis.relative_distance(guess, truth)
            self._sampled = (sample, noise)
            args = (sample.x, sample.valid, problem.scale, problem.bias)
            if checked.name == "out":
                found += diagnosis.diagnose_output(
                    sample.actual, *args, problem.eps, judge, noise=noise
                )
            elif nonfinite:
                nan = diagnosis.diagnose_nan_gradient(
                    "grad_x", sample.actual, truth, sample.x, sample.valid, sample.grad_out
                )
                found += [nan] if nan is not None else []
            else:
                assert sample.grad_out is not None
                found += diagnosis.diagnose_gradient(
                    sample.actual, *args, sample.grad_out, problem.eps, judge, noise=noise
                )
        elif nonfinite and problem.grad_out is not None:
            index = self.torch.tensor(self.poisoned, dtype=self.torch.long)
            reference = self.torch.zeros(problem.channels, dtype=self.torch.float64)
            nan = diagnosis.diagnose_nan_gradient(
                checked.name, self.result.tensor(checked.key), reference, problem.x[index],
                problem.valid[index], problem.grad_out[index],
            )  # fmt: skip
            found += [nan] if nan is not None else []
        if problem.eps_source == "default":
            found = [_eps_may_be_ours(d, problem.eps) for d in found]
        outcome.diagnosis = [d.to_dict() for d in found]

    def _sample(self, checked: Checked, rows: Sequence[int]) -> _Sample:
        """The failing ``rows`` and their surroundings, at most :data:`DIAGNOSIS_ELEMENTS`
        elements: whole sequences (the last leading axis) when they fit, so that a mistake
        along that axis shows, else the rows themselves."""
        torch = self.torch
        problem = self.problem
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
        actual = self.result.tensor(checked.key).reshape(-1, problem.channels)[index]
        grad_out = problem.grad_out[index].reshape(shape) if problem.grad_out is not None else None
        valid = problem.valid[index]
        if self.mask is not None:
            # Rows --valid left out are never blamed: the diagnosis sees them as padding,
            # zero on RESULT's side as on the reference's.
            keep = self.mask.keep[index]
            valid = valid & keep
            actual = torch.where(keep.unsqueeze(1), actual, torch.zeros((), dtype=actual.dtype))
        return _Sample(
            problem, actual.reshape(shape), problem.x[index].reshape(shape),
            valid.reshape(leading), grad_out,
        )  # fmt: skip


@dataclass
class _Sample:
    """Rows of INPUT and RESULT re-read for a diagnosis, in their leading shape."""

    problem: Problem
    actual: torch.Tensor
    x: torch.Tensor
    valid: torch.Tensor
    grad_out: torch.Tensor | None

    def reference(self, name: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The truth (float64) and PyTorch's result in ``dtype`` for ``name`` on these rows."""
        import torch

        from maskln_cli.op.api import masked_layer_normalization
        from maskln_cli.verify.budget import yardstick

        problem = self.problem
        channels = problem.channels
        rows, valid = self.x.reshape(-1, channels), self.valid.reshape(-1)
        upstream = self.grad_out.reshape(-1, channels) if name == "grad_x" else None
        leaf = rows.double().requires_grad_()
        with torch.enable_grad():
            out = masked_layer_normalization(leaf, valid, problem.scale, problem.bias, problem.eps)
            if upstream is not None:
                (truth,) = torch.autograd.grad(out, leaf, upstream.double())
            else:
                truth = out.detach()
        guess = yardstick(rows, valid, problem.scale, problem.bias, problem.eps, dtype, upstream)
        value = guess.out if upstream is None else guess.grad_x
        assert value is not None
        return truth.reshape(self.x.shape), value.double().reshape(self.x.shape)


def _eps_may_be_ours(found: Diagnosis, eps: float) -> Diagnosis:
    """An eps mistake seen when nobody gave eps may be the reference's: say so in its fix.

    Example:
        >>> from maskln_cli.op.mistakes import Diagnosis
        >>> d = Diagnosis("eps_missing", "eps missing", "add eps inside the sqrt", 0.0)
        >>> print(_eps_may_be_ours(d, 1e-5).fix)  # doctest: +NORMALIZE_WHITESPACE
        add eps inside the sqrt; or the kernel is right and its eps is not the default 1e-05
        this run used: give it with --eps or --config
    """
    if not found.mistake.startswith("eps_"):
        return found
    fix = (
        f"{found.fix}; or the kernel is right and its eps is not the default {eps:g} this run"
        " used: give it with --eps or --config"
    )
    return dataclasses.replace(found, fix=fix)


GENERIC = "a formula or eps mistake"
"""What the words say of rows all off by about the same, until a finding says which."""


def _replace_generic(problems: list[str], specific: str) -> bool:
    """Put ``specific`` in place of :data:`GENERIC` in the first problem saying it.

    Example:
        >>> problems = ["all 3 valid rows off; relative error 2e-05 ± 1e-06 (uniform: a formula"
        ...             " or eps mistake)"]
        >>> _replace_generic(problems, "eps ≈ 1e-06"), problems[0][-22:]
        (True, '(uniform: eps ≈ 1e-06)')
    """
    for index, problem in enumerate(problems):
        if GENERIC in problem:
            problems[index] = problem.replace(GENERIC, specific)
            return True
    return False
