"""``maskln verify INPUT RESULT``: judge a kernel's result against maskln's float64 truth.

RESULT (the kernel's output) is the *actual* side; maskln's reference, computed in float64
from INPUT whatever RESULT's dtype, is the *expected* side. By default each element is judged
by an error budget for the dtype the kernel computed in (:mod:`maskln_cli.verify.budget`): a correct
float32 kernel cannot match float64, but it can be about as accurate as PyTorch's own
``F.layer_norm`` in float32, which is run on the same data as a yardstick. ``--rtol`` and
``--atol`` (or ``--tolerance fixed``) judge by a fixed tolerance instead.

Everything is computed in one streaming pass, a chunk of rows at a time: the truth, the
yardstick and the budget of each chunk are compared with RESULT's rows and dropped; only the
gradient sums over rows are accumulated. A failing tensor is then described in words (which
rows, how uniformly) and diagnosed: known wrong formulas (:mod:`maskln_cli.op.mistakes`) are
evaluated on a bounded sample of its failing rows, and the one RESULT matches is named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from maskln_cli.compare.comparison import Comparison
from maskln_cli.compare.data import ComparisonReport, TensorComparison, times
from maskln_cli.compare.files import threads_for
from maskln_cli.compare.rows import count_left_out, leave_out
from maskln_cli.errors import MasklnError
from maskln_cli.files.masks import RowMask, open_row_mask, parse_mask_spec
from maskln_cli.files.problem import (
    GRADIENT_KEYS,
    NormalizeOptions,
    Problem,
    Progress,
    load_problem,
)
from maskln_cli.files.tensorfile import STDIO, TensorFile, open_tensor_file
from maskln_cli.verify.options import (
    ROW_TENSORS,
    VerifyOptions,
    check_options,
    parse_check,
    parse_result_keys,
)
from maskln_cli.verify.plan import Checked, Plan

if TYPE_CHECKING:
    import torch

    from maskln_cli.compare.data import BlockFigures
    from maskln_cli.op.mistakes import Diagnosis
    from maskln_cli.verify.budget import SumBudget, Yardstick

CHUNK_ELEMENTS = 1 << 19
"""Elements of x per chunk: the truth, yardstick and budget of a chunk are float64 temporaries
of 4 MiB each."""
GROUP_ELEMENTS = 1 << 22
"""Elements of x whose blocks are measured by one pool of threads (whole chunks)."""
GROUP_ROWS = 1 << 16
"""At most this many rows of x in such a group, but for a single chunk."""
DIAGNOSIS_ELEMENTS = 1 << 21
"""At most this many elements of failing rows are re-read for a diagnosis."""
UNIFORM_SPREAD = 0.3
"""Rows are off "uniformly" when their relative errors' spread is below this share of their
mean (and the mean is well above rounding): the signature of a formula mistake."""
YARDSTICK_RAISES = True
"""Whether the yardstick's error raises a budget where it exceeds the model (always, in use;
benchmarks/verify_calibration.py turns it off to measure the model alone)."""

__all__ = ["VerifyOptions", "parse_check", "parse_result_keys", "verify_file"]


def verify_file(
    input_path: str,
    result_path: str,
    options: NormalizeOptions | None = None,
    verify: VerifyOptions | None = None,
    progress: Progress | None = None,
) -> ComparisonReport:
    """Judge RESULT (a kernel's output) against maskln's float64 result for INPUT.

    Example:
        >>> report = verify_file("sample_data/pair_features.safetensors",
        ...                      "sample_data/pair_features_expected.safetensors")
        >>> report.passed, [t.name for t in report.tensors], report.context["eps_source"]
        (True, ['out', 'grad_x', 'grad_scale', 'grad_bias'], "metadata 'eps'")
    """
    options = options or NormalizeOptions()
    verify = verify or VerifyOptions()
    check_options(verify)
    if input_path == STDIO and result_path == STDIO:
        raise MasklnError("INPUT and RESULT cannot both be '-' (stdin)")
    if verify.valid is not None and parse_mask_spec(verify.valid)[0] == STDIO:
        raise MasklnError("--valid: give a file (stdin carries INPUT or RESULT)")
    with contextlib.ExitStack() as stack:
        # The reference is float64 whatever x's dtype: parameters are read exactly as stored.
        reference_options = dataclasses.replace(options, dtype="float64")
        problem = stack.enter_context(load_problem(input_path, reference_options))
        result = stack.enter_context(open_tensor_file(result_path))
        mask = stack.enter_context(open_row_mask(verify.valid)) if verify.valid else None
        if mask is not None and not mask.applies_to(problem.shape):
            raise MasklnError(
                f"--valid: {mask.source} has shape {list(mask.shape)}; expected x's leading"
                f" shape {list(problem.shape[:-1])}"
            )
        job = _Job(problem, result, options, verify, mask)
        return job.run(progress)


class _Job:
    """The verification of one RESULT against one INPUT: set up, one streaming pass, words."""

    def __init__(
        self,
        problem: Problem,
        result: TensorFile,
        options: NormalizeOptions,
        verify: VerifyOptions,
        mask: RowMask | None = None,
    ) -> None:
        import torch

        self.plan = plan = Plan(problem, result, options, verify)
        self.problem = problem
        self.mask = mask
        self.result = result
        self.verify = verify
        self.mode = plan.mode
        self.factor = plan.factor
        self.notes = plan.notes
        self.names = plan.names
        self.keys = plan.keys
        self.judge = plan.judge
        self.precision = plan.precision
        self.checked = plan.checked
        self.valid_rows = plan.valid_rows
        self.chunk_rows = options.chunk_rows or max(2, CHUNK_ELEMENTS // problem.channels)
        self.poisoned: list[int] = []  # invalid rows with NaN or inf in x or grad_out
        self.torch = torch

    # --- the streaming pass ---------------------------------------------------------------

    def run(self, progress: Progress | None) -> ComparisonReport:
        from maskln_cli.op.blocked import row_blocks
        from maskln_cli.verify.budget import SumBudget

        problem = self.problem
        comparing = {c.name: c for c in self.checked if c.comparison is not None}
        live = {n: c for n, c in comparing.items() if c.comparison.comparable}  # type: ignore[union-attr]
        # Gradients are computed only when RESULT holds one to compare, values only when
        # RESULT holds anything to compare.
        gradients = problem.grad_out is not None and any(n in live for n in GRADIENT_KEYS)
        sums = _Sums(problem.channels) if gradients else None
        sum_budget = SumBudget(problem.channels, self.precision) if gradients else None
        # Without gradients (sums over rows), every step is row by row: a chunk's rows are
        # then computed in blocks on worker threads.
        blocked = sums is None
        chunks = list(row_blocks(problem.rows, self.chunk_rows)) if live else []
        done = 0
        while done < len(chunks):
            # The first chunk alone: its merged ratio spares later blocks work (see
            # Comparison.measure); then several chunks' blocks to one pool of threads.
            group = self._group(chunks, done) if blocked and done else chunks[done : done + 1]
            measured = self._measure_chunks(group, live) if blocked else [None] * len(group)
            for (start, stop), figures in zip(group, measured, strict=True):
                if figures is None:  # not blocked, or a block holds NaN or inf
                    self._chunk(start, stop, live, sums, sum_budget)
                else:
                    self._merge_chunk(start, stop, live, figures)
                if progress:
                    progress(stop, problem.rows)
            done += len(group)
        if sums is not None and sum_budget is not None:
            self._compare_sums(live, sums, sum_budget)
        tensors = []
        for checked in self.checked:
            if checked.comparison is not None:
                checked.outcome = checked.comparison.result(compared=checked.name in live)
                if self.mask is not None and checked.name in live and checked.name in ROW_TENSORS:
                    count_left_out(checked.outcome, self.mask.left_out)
                self._describe(checked)
            tensors.append(checked.outcome)
        if self.mask is not None:
            mask = self.mask
            compared = ", ".join(n for n in ROW_TENSORS if n in live) or "nothing"
            self.notes.append(
                f"--valid {mask.source}: compared {mask.rows - mask.left_out:,} of"
                f" {mask.rows:,} rows of {compared}"
            )
        tensors += self.plan.unchecked()
        return ComparisonReport(
            "verify", self.result.name, problem.source, tensors, self.notes, self.plan.context()
        )

    def _chunk(
        self,
        start: int,
        stop: int,
        live: dict[str, Checked],
        sums: _Sums | None,
        sum_budget: SumBudget | None,
    ) -> None:
        from maskln_cli.op.api import masked_layer_normalization
        from maskln_cli.verify.budget import RowBudget, yardstick

        torch = self.torch
        problem = self.problem
        x = problem.x[start:stop]
        valid = problem.valid[start:stop]
        x64 = x.double()
        grad_out = problem.grad_out[start:stop] if sums is not None else None  # type: ignore[index]
        dy64 = grad_out.double() if grad_out is not None else None
        if dy64 is not None:
            leaves = [t.detach().requires_grad_() for t in (x64, problem.scale, problem.bias)]
            with torch.enable_grad():
                out = masked_layer_normalization(
                    leaves[0], valid, leaves[1], leaves[2], problem.eps
                )
                grads = torch.autograd.grad(out, leaves, dy64)
            truth = dict(zip(GRADIENT_KEYS, grads, strict=True), out=out.detach())
        else:
            with torch.no_grad():
                truth = {
                    "out": masked_layer_normalization(
                        x64, valid, problem.scale, problem.bias, problem.eps
                    )
                }
        self._note_poison(start, x, valid, grad_out)
        judge = yardstick(x, valid, problem.scale, problem.bias, problem.eps, self.judge, grad_out)
        rows = RowBudget(x64, valid, problem.scale, problem.bias, problem.eps, self.precision)
        keep = self.mask.keep[start:stop] if self.mask is not None else None
        for name in ROW_TENSORS:
            checked = live.get(name)
            if checked is None:
                continue
            reference = truth[name]
            guess = judge.out if name == "out" else judge.grad_x
            comparison = checked.comparison
            assert comparison is not None and guess is not None
            actual = self.result.tensor(checked.key).reshape(-1, problem.channels)[start:stop]
            invalid = ~valid
            if keep is not None:  # --valid: rows left out agree (0 on every side)
                actual, reference = leave_out(actual, reference, keep)
                guess, _ = leave_out(guess, reference, keep)
                invalid = invalid & keep
            if self.mode == "budget":
                model = rows.out() if name == "out" else rows.grad_x(dy64)  # type: ignore[arg-type]
                pieces = self._allowance(checked, model, guess, reference, valid.unsqueeze(1))
            else:  # the fixed tolerance alone, as assert_close has it; padding exactly 0
                allowed = reference.abs().mul_(comparison.rtol).add_(comparison.atol)
                pieces = {"allowance": allowed.masked_fill_(~valid.unsqueeze(1), 0.0)}
            comparison.update(actual, reference, invalid, yardstick=guess, **pieces)
        if sums is not None and sum_budget is not None and dy64 is not None:
            sums.add(truth["grad_scale"], truth["grad_bias"], judge)
            rows.add_to(sum_budget, dy64)

    def _group(self, chunks: list[tuple[int, int]], first: int) -> list[tuple[int, int]]:
        """Chunks from ``chunks[first]`` whose blocks are measured together: about
        :data:`GROUP_ELEMENTS` elements (a pool of threads costs milliseconds to start), and
        at most :data:`GROUP_ROWS` rows (their per-row figures wait to be merged)."""
        channels = self.problem.channels
        stop = first
        rows = 0
        while stop < len(chunks) and (stop == first or (
            (rows + chunks[stop][1] - chunks[stop][0]) * channels <= GROUP_ELEMENTS
            and rows + chunks[stop][1] - chunks[stop][0] <= GROUP_ROWS
        )):  # fmt: skip
            rows += chunks[stop][1] - chunks[stop][0]
            stop += 1
        return chunks[first:stop]

    def _measure_chunks(
        self, chunks: list[tuple[int, int]], live: dict[str, Checked]
    ) -> list[list[dict[str, BlockFigures]] | None]:
        """:meth:`_chunk` without gradients for consecutive ``chunks``, their rows in
        cache-sized blocks measured on worker threads (see :meth:`Comparison.measure`), for
        :meth:`_merge_chunk`: the same figures, bit for bit, as every step is row by row.
        None for a chunk with a block holding NaN or inf on either side: :meth:`_chunk` then
        compares it."""
        from maskln_cli.compare.comparison import BLOCK_ELEMENTS
        from maskln_cli.op.blocked import row_blocks
        from maskln_cli.op.threads import map_blocks

        problem = self.problem
        block_rows = BLOCK_ELEMENTS // problem.channels
        blocks = [
            (start + a, start + b)
            for start, stop in chunks
            for a, b in row_blocks(stop - start, block_rows)
        ]
        results = {
            name: self.result.tensor(checked.key).reshape(-1, problem.channels)
            for name, checked in live.items()
        }
        measured = map_blocks(lambda block: self._measure_block(*block, live, results), blocks)
        by_chunk: list[list[dict[str, BlockFigures]] | None] = []
        for start, stop in chunks:
            count = len(list(row_blocks(stop - start, block_rows)))
            figures, measured = measured[:count], measured[count:]
            by_chunk.append(None if any(f is None for f in figures) else figures)  # type: ignore[misc]
        return by_chunk

    def _merge_chunk(
        self,
        start: int,
        stop: int,
        live: dict[str, Checked],
        measured: list[dict[str, BlockFigures]],
    ) -> None:
        """Merge the figures of the blocks of rows ``start:stop`` (see :meth:`_measure_chunks`)."""
        valid = self.problem.valid[start:stop]
        invalid = ~valid if self.mask is None else ~valid & self.mask.keep[start:stop]
        # Small work on the main thread: on torch's own threads it waits for them to wake,
        # which on a busy machine took longer than measuring the blocks. Only below
        # ONE_THREAD_BELOW rows, where torch would not split the sums anyway: the same bits.
        with threads_for(stop - start):
            self._note_poison(start, self.problem.x[start:stop], valid, None)
            for name in ROW_TENSORS:
                checked = live.get(name)
                if checked is not None:
                    assert checked.comparison is not None
                    parts = [figures[name] for figures in measured]
                    checked.comparison.merge(parts, invalid)

    def _measure_block(
        self, start: int, stop: int, live: dict[str, Checked], results: dict[str, torch.Tensor]
    ) -> dict[str, BlockFigures] | None:
        """The truth, yardstick and allowance of rows ``start:stop``, as :meth:`_chunk` makes
        them, measured against RESULT (None when a value is NaN or inf)."""
        from maskln_cli.op.api import masked_layer_normalization
        from maskln_cli.verify.budget import yardstick

        torch = self.torch
        problem = self.problem
        x = problem.x[start:stop]
        valid = problem.valid[start:stop]
        x64 = x.double()
        with torch.no_grad():
            truth = masked_layer_normalization(x64, valid, problem.scale, problem.bias, problem.eps)
        guess = yardstick(x, valid, problem.scale, problem.bias, problem.eps, self.judge).out
        actual = results["out"][start:stop]
        invalid = ~valid
        if self.mask is not None:  # --valid: rows left out agree (0 on every side)
            keep = self.mask.keep[start:stop]
            actual, truth = leave_out(actual, truth, keep)
            guess, _ = leave_out(guess, truth, keep)
            invalid = invalid & keep
        # |yardstick - truth|: for the budget and the comparison alike, computed once.
        error = (guess.double() - truth).abs_()
        measured: dict[str, BlockFigures] = {}
        checked = live.get("out")  # grad_x is checked only with gradients: not here
        if checked is None:
            return measured
        comparison = checked.comparison
        assert comparison is not None
        allowance_of = functools.partial(
            self._allowance_of, checked, (x64, valid, truth, guess, error)
        )
        # Every element of a valid row is allowed atol or more: what is always allowed
        # (budget.floor) adds it, and the allowance is at least that.
        figures = comparison.measure(
            actual, truth, invalid, yardstick=guess, yardstick_error=error,
            allowance_of=allowance_of, lower=comparison.atol,
        )  # fmt: skip
        if figures is None:
            return None
        measured["out"] = figures
        return measured

    def _allowance_of(
        self,
        checked: Checked,
        inputs: tuple[torch.Tensor, ...],
        rows: torch.Tensor | None,
        later: bool = False,
    ) -> dict[str, torch.Tensor] | Callable[[], dict[str, torch.Tensor]]:
        """The allowance pieces of some rows of a block (None: all of them) for
        :meth:`Comparison.measure`, from the block's ``inputs`` (x in float64, valid, the
        truth, the yardstick and its error); ``later``, a function making them from copies of
        just those rows."""
        if rows is None:
            return self._pieces(checked, *inputs)
        some = [t.index_select(0, rows) for t in inputs]
        if later:
            return functools.partial(self._pieces, checked, *some)
        return self._pieces(checked, *some)

    def _pieces(
        self,
        checked: Checked,
        x64: torch.Tensor,
        valid: torch.Tensor,
        truth: torch.Tensor,
        guess: torch.Tensor,
        error: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """The allowance pieces of rows of x (float64), as :meth:`_chunk` makes them."""
        from maskln_cli.verify.budget import RowBudget

        comparison = checked.comparison
        assert comparison is not None
        problem = self.problem
        if self.mode == "budget":
            budget = RowBudget(x64, valid, problem.scale, problem.bias, problem.eps, self.precision)
            return self._allowance(checked, budget.out(), guess, truth, valid.unsqueeze(1), error)
        allowed = truth.abs().mul_(comparison.rtol).add_(comparison.atol)
        return {"allowance": allowed.masked_fill_(~valid.unsqueeze(1), 0.0)}

    def _note_poison(
        self, start: int, x: torch.Tensor, valid: torch.Tensor, grad_out: torch.Tensor | None
    ) -> None:
        """Remember a few invalid rows holding NaN or inf (in x or grad_out): a NaN gradient's
        diagnosis looks for them."""
        if len(self.poisoned) >= 64 or bool(valid.all()):
            return
        invalid = (~valid).nonzero().squeeze(1)  # only they are looked at
        if grad_out is None:
            # A row's sum is finite only if its every value is (NaN and inf carry into it):
            # only rows whose sum is not are looked at value by value (isfinite is slow).
            sums = x.sum(dim=1)[invalid]
            invalid = invalid[~sums.isfinite()]
        bad = ~x[invalid].isfinite().all(dim=1)
        if grad_out is not None:
            bad |= ~grad_out[invalid].isfinite().all(dim=1)
        rows = invalid[bad][: 64 - len(self.poisoned)]
        self.poisoned += (rows + start).tolist()

    def _compare_sums(self, live: dict[str, Checked], sums: _Sums, sum_budget: SumBudget) -> None:
        for name, total, guess in (
            ("grad_scale", sums.scale, sums.judge_scale),
            ("grad_bias", sums.bias, sums.judge_bias),
        ):
            checked = live.get(name)
            if checked is None:
                continue
            comparison = checked.comparison
            assert comparison is not None
            # The yardstick is summed in float64 over chunks, then rounded as one call would.
            guess = guess.to(self.judge).double()
            actual = self.result.tensor(checked.key)
            if self.mode == "budget":
                model = getattr(sum_budget, name)(total)
                pieces = self._allowance(checked, model, guess, total, None)
            else:
                pieces = {"allowance": total.abs().mul(comparison.rtol).add_(comparison.atol)}
            comparison.update(actual, total, yardstick=guess, **pieces)

    def _allowance(
        self,
        checked: Checked,
        model: torch.Tensor,
        guess: torch.Tensor,
        reference: torch.Tensor,
        valid: torch.Tensor | None,
        error: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Each element's budget (0 on invalid rows, ``valid`` being one flag per row) and the
        pieces it is made of, as :meth:`Comparison.update` takes them. ``error`` is the
        yardstick's, ``|guess - reference|``, when the caller has it."""
        import torch

        from maskln_cli.verify import budget

        comparison = checked.comparison
        assert comparison is not None
        dtype = _torch_dtype(comparison.dtype) or self.judge
        if error is None and YARDSTICK_RAISES:
            error = (guess.double() - reference).abs_()
        unit = budget.unit(model, error if YARDSTICK_RAISES else None)
        always = budget.floor(reference, dtype, comparison.rtol, comparison.atol)
        allowed = torch.maximum(unit * self.factor, always)
        if valid is not None and not bool(valid.all()):  # else masking changes nothing
            allowed.masked_fill_(~valid, 0.0)
            always = always.masked_fill(~valid, math.inf)  # the padding is another matter
        return {"allowance": allowed, "budget_unit": unit, "always": always}

    # --- words ----------------------------------------------------------------------------

    def _describe(self, checked: Checked) -> None:
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
            truth, guess = sample.reference(checked.name, self.judge)
            noise = diagnosis.relative_distance(guess, truth)
            args = (sample.x, sample.valid, problem.scale, problem.bias)
            if checked.name == "out":
                found += diagnosis.diagnose_output(
                    sample.actual, *args, problem.eps, self.judge, noise=noise
                )
            elif nonfinite:
                nan = diagnosis.diagnose_nan_gradient(
                    "grad_x", sample.actual, truth, sample.x, sample.valid, sample.grad_out
                )
                found += [nan] if nan is not None else []
            else:
                assert sample.grad_out is not None
                found += diagnosis.diagnose_gradient(
                    sample.actual, *args, sample.grad_out, problem.eps, self.judge, noise=noise
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
        return _Sample(
            self, actual.reshape(shape), problem.x[index].reshape(shape),
            problem.valid[index].reshape(leading), grad_out,
        )  # fmt: skip


@dataclass
class _Sample:
    """Rows of INPUT and RESULT re-read for a diagnosis, in their leading shape."""

    job: _Job
    actual: torch.Tensor
    x: torch.Tensor
    valid: torch.Tensor
    grad_out: torch.Tensor | None

    def reference(self, name: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The truth (float64) and PyTorch's result in ``dtype`` for ``name`` on these rows."""
        import torch

        from maskln_cli.op.api import masked_layer_normalization
        from maskln_cli.verify.budget import yardstick

        problem = self.job.problem
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


class _Sums:
    """grad_scale and grad_bias accumulated over chunks in float64: the truth's and the
    yardstick's (each chunk's share, in the judged dtype, added in float64)."""

    def __init__(self, channels: int) -> None:
        import torch

        zeros = torch.zeros(channels, dtype=torch.float64)
        self.scale, self.bias = zeros.clone(), zeros.clone()
        self.judge_scale, self.judge_bias = zeros.clone(), zeros.clone()

    def add(self, scale: torch.Tensor, bias: torch.Tensor, judge: Yardstick) -> None:
        assert judge.grad_scale is not None and judge.grad_bias is not None
        self.scale += scale
        self.bias += bias
        self.judge_scale += judge.grad_scale.double()
        self.judge_bias += judge.grad_bias.double()


def _torch_dtype(name: str | None) -> torch.dtype | None:
    from maskln_cli.files.tensorfile import torch_dtype

    return torch_dtype(name) if name else None


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
