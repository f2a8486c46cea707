"""What is wrong with a failing tensor of ``maskln verify``, in words, and one explanation.

After the streaming pass each compared tensor has its figures; :class:`Explainer` replaces the
generic problem lines of a failing one with what is wrong (non-finite values, the padding, the
valid rows: all of them or some, uniformly or not, or the elements of a sum), tests it for a
systematic error (:mod:`.systematic`), and gives it one explanation, said alike by its problem
line, its diagnosis and the verdict line (:attr:`TensorComparison.explanation`): in order,

1. what RESULT itself shows (:mod:`.findings`: a coarser dtype's values, a wrong --module, a
   model's own padding), said first;
2. what its systematic error's model names: another eps, or a mistake of the catalogue;
3. the diagnosis of a sample of its failing rows (:mod:`.diagnose`), trying first what an
   earlier tensor of RESULT was explained by; or NaN from the padding;
4. for a sum over rows, an earlier tensor's explanation, when it is systematic by a factor of
   the same sign and size;
5. the systematic error in words; else the words alone.

Tensors are explained in the order out, grad_x, grad_scale, grad_bias, whatever --check's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from maskln_cli.compare.data import times
from maskln_cli.verify.causes import Causes, leading_index, where
from maskln_cli.verify.options import ROW_TENSORS

if TYPE_CHECKING:
    from maskln_cli.compare.comparison import Comparison
    from maskln_cli.compare.data import TensorComparison
    from maskln_cli.files.masks import RowMask
    from maskln_cli.op.mistakes import Diagnosis
    from maskln_cli.verify.plan import Checked, Plan
    from maskln_cli.verify.systematic import Finding, FitSums

UNIFORM_SPREAD = 0.3
"""Rows are off "uniformly" when their relative errors' spread is below this share of their
mean (and the mean is well above rounding): the signature of a formula mistake."""
ROUNDING_ENERGY = 4.0
"""The error energy a correct kernel's rounding may reach, in units of PyTorch's own (twice its
error in rms): what is beyond it must be most of what a factor or shift is said to be."""
GENERIC = "the same mistake in every row"
"""What the words say of rows all off by about the same, until an explanation says which: what
the evidence shows, no cause (a formula, an eps, a permutation of the channels all give it)."""


class Explainer:
    """The words and the one explanation of a plan's failing tensors, once measured."""

    def __init__(
        self,
        plan: Plan,
        poisoned: list[int],
        fits: dict[str, FitSums] | None = None,
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
        self.fits = fits or {}  # each tensor's systematic-error regressions
        self.mask = mask
        self.causes = Causes(plan, poisoned, mask, self._eps_origin(), self._wrong, self.fits)
        self.not_checked: list[str] = []  # what the systematic test could not see, in words
        self.torch = torch

    # --- words ----------------------------------------------------------------------------

    def describe(self, checked: Checked) -> None:
        """Replace the generic problem lines of a failing tensor with what is wrong, in words,
        test it for a systematic error, and explain it."""
        outcome = checked.outcome
        comparison = checked.comparison
        assert outcome is not None and comparison is not None
        structural = [p for p in outcome.problems if p.startswith(("shape", "dtype"))]
        if outcome.numel is None:  # values not compared
            outcome.explanation = _one_level(outcome.problems[0]) if outcome.problems else None
            return
        words = words_of(
            checked.name, outcome, comparison, self.mode, self.problem.rows, self.valid_rows
        )
        if self.verify.strict and outcome.negative_zeros:
            words.append(
                f"-0.0 at {outcome.negative_zeros:,} padded positions (+0.0 expected; --strict)"
            )
        finding = self._systematic(checked)
        found = finding if finding is not None and finding.systematic else None
        said = any(GENERIC in word for word in words)  # the explanation takes its place
        if found is not None and not self.verify.allow_systematic and not said:
            words.append(found.sentence())
        outcome.problems = structural + words
        outcome.passed = not outcome.problems
        if checked.name == "out":
            self.causes.out_right = outcome.passed
        if self.mode == "budget":
            # None when no factor would do: NaN or inf, or padding not zeroed.
            fixable = not (outcome.nan_mismatched or outcome.inf_mismatched) and (
                outcome.invalid_rows_zero is not False
            )
            outcome.factor_needed = comparison.factor_needed() if fixable else None
        if not outcome.passed:
            self._explain(checked, found)
        elif finding is not None and finding.limit is not None and found is None:
            rows = f"with {finding.rows:,} valid {'row' if finding.rows == 1 else 'rows'}"
            if finding.unit == "elements":  # a sum's: its rows (distinct ones) are few
                from maskln_cli.verify.systematic import MIN_ROWS

                rows = f"summed over fewer than {MIN_ROWS} distinct valid rows"
            self.not_checked.append(
                f"{checked.name}: {rows}, a systematic error below {finding.limit:.1g}"
                " (relative) cannot be told from rounding"
                if math.isfinite(finding.limit)
                else f"{checked.name}: {rows} of {self.problem.channels} channels, a"
                " systematic error cannot be told from rounding"
            )

    def _wrong(self, name: str) -> bool | None:
        """Whether RESULT's ``name`` is wrong: beyond its budget, or systematic (None: not
        checked), before it is explained."""
        checked = next((c for c in self.plan.checked if c.name == name), None)
        if checked is None or checked.comparison is None or not checked.comparison.comparable:
            return None
        if checked.comparison.beyond or checked.comparison.nan_mismatched:
            return True
        from maskln_cli.verify import systematic

        fit = self.fits.get(name)
        if fit is None or self.mode != "budget":
            return False
        precision = self.plan.precisions[checked.judge or self.judge]
        found = systematic.pooled(fit, precision, self.problem.eps, 1.0, 0.0, self.problem.channels)
        return found is not None and found.systematic

    def _systematic(self, checked: Checked) -> Finding | None:
        """A tensor's pooled systematic-error regressions (None: not tested)."""
        from maskln_cli.verify import systematic

        fit = self.fits.get(checked.name)
        if fit is None or self.mode != "budget":
            return None
        precision = self.plan.precisions[checked.judge or self.judge]
        problem = self.problem
        scale, bias = 1.0, 0.0  # a gradient's shift is measured against its own size
        if checked.name == "out":
            scale, bias = (float(t.square().mean().sqrt()) for t in (problem.scale, problem.bias))
        finding = systematic.pooled(fit, precision, problem.eps, scale, bias, problem.channels)
        if finding is not None and finding.unit == "rows":
            finding.of = self.valid_rows  # more than its rows when a sample was regressed
            if isinstance(finding.row, int):
                finding.row = leading_index(finding.row, tuple(problem.shape[:-1]))
        elif finding is not None and checked.outcome is not None:
            finding.of = checked.outcome.numel  # the elements regressed are not always all
        if finding is not None and finding.of and checked.comparison is not None:
            # RESULT's error energy beyond rounding (ROUNDING_ENERGY times PyTorch's own), over
            # what was regressed (a sample: its share of the whole); none beyond: not known.
            comparison = checked.comparison
            beyond = comparison.diff_squares - ROUNDING_ENERGY * comparison.yardstick_squares
            if comparison.yardstick_squares > 0 and beyond > 0:
                finding.error_energy = beyond * min(1.0, finding.rows / finding.of)
        if finding is not None and (finding.systematic or systematic.ALWAYS_REPORT):
            checked.outcome.systematic = finding.to_dict()  # type: ignore[union-attr]
        return finding

    # --- one explanation --------------------------------------------------------------------

    def _explain(self, checked: Checked, found: Finding | None) -> None:
        """Give a failing tensor one explanation (see the module's docstring): its diagnosis,
        the words it takes the place of, and the phrase the verdict line says."""
        outcome = checked.outcome
        assert outcome is not None
        diagnosis = self.causes.diagnose(checked, found)
        if diagnosis is not None and self.problem.eps_source == "default":
            diagnosis = _eps_may_be_ours(diagnosis, self.problem.eps)
        outcome.diagnosis = [diagnosis.to_dict()] if diagnosis is not None else []
        phrase = phrase_of(diagnosis) if diagnosis is not None else None
        if phrase is None and found is not None:  # no name for it: the systematic error
            phrase = found.sentence()
            if _replace_generic(outcome.problems, phrase):
                found = None  # said in place of the generic words
        specific = self._specific(checked)
        if specific:
            for text in specific:
                _replace_generic(outcome.problems, text)
            outcome.problems = specific + [p for p in outcome.problems if p not in specific]
            phrase = specific[0]
        elif phrase is not None and not _replace_generic(outcome.problems, phrase):
            sentence = found.sentence() if found is not None else None
            if sentence in outcome.problems and sentence != phrase:  # the error, and what it is
                outcome.problems[outcome.problems.index(sentence)] += f"; {phrase}"
        if diagnosis is None and not specific and self._beyond(checked):
            # No cause: say so, and where the error is.
            leading = tuple(self.problem.shape[:-1])
            words = where(checked, self.problem.valid, leading, self.causes.current)
            index = next((i for i, p in enumerate(outcome.problems) if "beyond" in p
                          or "valid rows off" in p), 0)  # fmt: skip
            outcome.problems[index] += f"; {words}"
        outcome.explanation = _every_aspect(outcome.problems, phrase)
        self.causes.said(checked, diagnosis, found)

    def _beyond(self, checked: Checked) -> bool:
        """Whether a failing tensor's values are beyond their budget, or non-finite, on its
        valid rows (not only its padding): what an unexplained error's words then locate."""
        comparison = checked.comparison
        assert comparison is not None
        outcome = checked.outcome
        assert outcome is not None
        nonfinite = (outcome.nan_where_finite or 0) + (outcome.inf_where_finite or 0)
        in_valid_rows = nonfinite - comparison.nonfinite_in_invalid_rows
        return comparison.beyond - comparison.beyond_in_invalid_rows > 0 or in_valid_rows > 0

    def _specific(self, checked: Checked) -> list[str]:
        """What kind of wrong, beyond the catalogue (see :mod:`.findings`), said first: a
        coarser kernel's values widened, a wrong --module, a model's own padding."""
        from maskln_cli.verify import findings

        outcome = checked.outcome
        assert outcome is not None and outcome.dtype is not None
        specific: list[str] = []
        if self.verify.dtype == "auto":
            coarser = findings.exact_in_coarser_dtype(
                self.result.tensor(checked.key), outcome.dtype
            )
            if coarser is not None and _rounded_alike(outcome, coarser):
                specific.append(
                    f"every value is exactly a {coarser}, stored as {outcome.dtype}: a"
                    f" {coarser} kernel judged by {outcome.dtype}'s budget; --dtype {coarser}"
                    " judges it as one"
                )
        options = self.plan.options
        if not self.problem.norm.centered:  # what follows compares with LayerNorm's formula
            return specific
        if checked.name == "out" and options.module and options.params and self.causes.sampled:
            sample, noise = self.causes.sampled
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
            # A model's own nn.LayerNorm normalizes every padding row and leaves the valid
            # ones right: a few rows normalized (a length off by one) are not its output.
            every_invalid_row = outcome.mismatched_invalid_rows == valid.numel() - int(valid.sum())
            if (
                every_invalid_row
                and not self._beyond(checked)
                and findings.plain_padding(self.problem, self.result, checked.key, rows)
            ):
                specific.append(
                    "the invalid rows hold a plain LayerNorm of x (a model's own"
                    " nn.LayerNorm output?): --plain-layer-norm compares the valid rows only"
                )
        return specific

    def _eps_origin(self) -> str:
        source = self.problem.eps_source
        return "the default" if source == "default" else f"from {source}"


COARSER_FIT = 16.0
"""A tensor whose values all lie on a coarser dtype's grid is called that dtype's kernel only
when its rows err by at most this many of that dtype's unit roundoff on average: cancellation
noise (grad_x of two channels, nearly 0) has few significant bits, on every grid, and errs by
its whole size."""


def _rounded_alike(outcome: TensorComparison, coarser: str) -> bool:
    """Whether ``outcome``'s rows err as a ``coarser`` kernel's would (True when its rows'
    errors were not measured: a gradient of scale or bias)."""
    import torch

    errors = outcome.row_rel_error
    if errors is None or not errors.rows:
        return True
    unit = torch.finfo(getattr(torch, coarser)).eps / 2
    return errors.mean <= COARSER_FIT * unit


def words_of(
    name: str,
    outcome: TensorComparison,
    comparison: Comparison,
    mode: str,
    rows: int,
    valid_rows: int,
) -> list[str]:
    """What is wrong with a tensor, in words: non-finite values, the padding, the valid
    rows (all of them or some, uniformly or not), or the elements of a sum (``mode``: the
    tolerance's; ``rows`` and ``valid_rows``: INPUT's)."""
    words: list[str] = []
    numel = outcome.numel or 0
    allowed = "budget" if mode == "budget" else "tolerance"
    invalid_total = rows - valid_rows
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
    elif nonfinite and name in ROW_TENSORS and comparison.nonfinite_in_invalid_rows == 0:
        where = ", all in valid rows (the padding's are right)"
    for kind, count in (("NaN", outcome.nan_where_finite), ("inf", outcome.inf_where_finite)):
        if count:
            words.append(
                f"{kind} where the reference is finite at {count:,} of {numel:,} elements{where}"
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
            words.append(f"{comparison.beyond:,} of {numel:,} elements beyond the {allowed}{worst}")
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
        uniform = _uniform(outcome, comparison, valid_rows)
        if bad_valid == valid_rows and errors is not None:
            shape = f"uniform: {GENERIC}" if uniform else "varying from row to row"
            words.append(
                f"all {valid_rows:,} valid rows off; relative error"
                f" {errors.mean:.2g} ± {errors.std:.1g}, {shape}"
            )
        else:
            text = (
                f"{beyond_valid:,} elements in {bad_valid:,} of {valid_rows:,} valid"
                f" rows beyond the {allowed}{worst}"
            )
            if uniform and errors is not None:
                text += (
                    f"; yet every valid row is off by about the same (relative error"
                    f" {errors.mean:.2g} ± {errors.std:.1g} in all {errors.rows:,}):"
                    f" {GENERIC}"
                )
            words.append(text)
    return words


def _uniform(outcome: TensorComparison, comparison: Comparison, valid_rows: int) -> bool:
    """Every valid row off by about the same relative error, well above rounding."""
    errors = outcome.row_rel_error
    if errors is None or errors.rows < 2 or errors.rows < valid_rows or errors.mean <= 0:
        return False
    noise = comparison.yardstick_row_error_sum / errors.rows
    return errors.std <= UNIFORM_SPREAD * errors.mean and errors.mean >= 3 * noise


def phrase_of(diagnosis: Diagnosis) -> str:
    """A diagnosis as the problem line and the verdict line say it: its description, and for
    a rounding of a coarser dtype what to do (the diagnosis line gives the fix in full).

    Example:
        >>> from maskln_cli.op.mistakes import Diagnosis
        >>> phrase_of(Diagnosis("rounding_float16", "errors look like float16 rounding"
        ...                     " (as sums accumulated in float16): ...", "accumulate in float32:"
        ...                     " the row sums ...", 0))
        'errors look like float16 rounding: accumulate in float32'
    """
    if diagnosis.mistake == "eps_mismatch":  # with what to give, as the fix says first
        action = diagnosis.fix.split(";", 1)[0].removeprefix("if RESULT's eps is the right one, ")
        return f"{diagnosis.description}: {action}"
    if diagnosis.mistake.startswith("rounding_"):
        head = diagnosis.description.split(" (", 1)[0]
        return f"{head}: {diagnosis.fix.split(':', 1)[0]}"
    return diagnosis.description


def _about_padding(text: str) -> bool:
    """Whether a problem line (or a cause's phrase) is about the invalid rows."""
    return any(word in text for word in ("invalid row", "padding", "padded"))


def _every_aspect(problems: list[str], phrase: str | None) -> str:
    """A failing tensor's one explanation for the verdict line: its cause's phrase (else its
    first problem), and the other aspect's first problem line when that says something else:
    the padding not zeroed beside wrong values, or wrong values beside the padding. A cause
    about the padding stands for both.

    Example:
        >>> problems = ["9 of 9 invalid rows not zeroed", "all 20 valid rows off; ...: eps"]
        >>> _every_aspect(problems, "eps 0.001")
        'eps 0.001; 9 of 9 invalid rows not zeroed'
        >>> _every_aspect(problems, None)
        '9 of 9 invalid rows not zeroed; all 20 valid rows off; ...: eps'
    """
    lead = phrase if phrase is not None else problems[0]
    said = [phrase if phrase is not None else _one_level(lead)]
    if phrase is not None and _about_padding(phrase):
        return said[0]
    # The line the phrase was said in (appended to it, or in place of its generic words).
    carrier = next((p for p in problems if phrase is not None and phrase in p), lead)
    padding = _about_padding(carrier)
    other = next(
        (p for p in problems if p != carrier and _about_padding(p) is not padding
         and not p.startswith(("shape", "dtype"))),
        None,
    )  # fmt: skip
    if other is not None:
        said.append(_one_level(other))
    return "; ".join(said)


def _one_level(text: str) -> str:
    """A problem line for the verdict line: a last parenthesis made a clause.

    Example:
        >>> _one_level("64 of 64 elements beyond the budget (worst 70x what is allowed)")
        '64 of 64 elements beyond the budget, worst 70x what is allowed'
    """
    if text.endswith(")") and text.count("(") == 1 and text.count(")") == 1:
        head, _, inner = text[:-1].partition(" (")
        return f"{head}, {inner}"
    return text


def _eps_may_be_ours(found: Diagnosis, eps: float) -> Diagnosis:
    """An eps mistake of the catalogue seen when nobody gave eps may be the reference's: say
    so in its fix.

    Example:
        >>> from maskln_cli.op.mistakes import Diagnosis
        >>> d = Diagnosis("eps_missing", "eps missing", "add eps inside the sqrt", 0.0)
        >>> print(_eps_may_be_ours(d, 1e-5).fix)  # doctest: +NORMALIZE_WHITESPACE
        add eps inside the sqrt; or the kernel is right and its eps is not the default 1e-05
        this run used: give it with --eps or --config
    """
    if not found.mistake.startswith("eps_") or found.mistake == "eps_mismatch":
        return found
    fix = (
        f"{found.fix}; or the kernel is right and its eps is not the default {eps:g} this run"
        " used: give it with --eps or --config"
    )
    return dataclasses.replace(found, fix=fix)


def _replace_generic(problems: list[str], specific: str) -> bool:
    """Put ``specific`` in place of :data:`GENERIC` in the first problem saying it.

    Example:
        >>> problems = ["all 3 valid rows off; relative error 2e-05 ± 1e-06, uniform: the same"
        ...             " mistake in every row"]
        >>> _replace_generic(problems, "eps ≈ 1e-06"), problems[0][-22:]
        (True, ', uniform: eps ≈ 1e-06')
    """
    for index, problem in enumerate(problems):
        if GENERIC in problem:
            problems[index] = problem.replace(GENERIC, specific)
            return True
    return False
