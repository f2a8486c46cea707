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

This module runs those steps, each in its own module: what is asked (:mod:`.options`), what is
checked and how (:mod:`.plan`), the streaming pass (:mod:`.measure`, with each element's
allowance from :mod:`.allowance`), and the words and diagnosis (:mod:`.explain`). It keeps the
public names: :class:`VerifyOptions`, :func:`parse_check`, :func:`parse_result_keys`,
:func:`verify_file` and :func:`verify_problem` (the judgement of inputs and results already
open, files or tensors in memory).
"""

from __future__ import annotations

import contextlib
import dataclasses

from maskln_cli.compare.data import ComparisonReport
from maskln_cli.compare.rows import count_left_out
from maskln_cli.errors import MasklnError
from maskln_cli.files.masks import RowMask, open_row_mask, parse_mask_spec, valid_key_hint
from maskln_cli.files.problem import NormalizeOptions, Problem, Progress, load_problem
from maskln_cli.files.tensorfile import STDIO, TensorFile, open_tensor_file
from maskln_cli.op.threads import one_thread
from maskln_cli.verify.explain import Explainer
from maskln_cli.verify.measure import StreamingPass
from maskln_cli.verify.options import (
    ROW_TENSORS,
    TENSORS,
    VerifyOptions,
    check_options,
    parse_check,
    parse_result_keys,
)
from maskln_cli.verify.plan import Checked, Plan

YARDSTICK_RAISES = True
"""Whether the yardstick's error raises a budget where it exceeds the model (always, in use;
benchmarks/verify_calibration.py turns it off to measure the model alone). Read when a job
starts, and handed to its :class:`~maskln_cli.verify.allowance.Allowance`."""

__all__ = ["VerifyOptions", "parse_check", "parse_result_keys", "verify_file", "verify_problem"]


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
        return verify_problem(problem, result, options, verify, mask, progress)


def verify_problem(
    problem: Problem,
    result: TensorFile,
    options: NormalizeOptions,
    verify: VerifyOptions,
    mask: RowMask | None = None,
    progress: Progress | None = None,
) -> ComparisonReport:
    """Judge ``result`` against the float64 truth for ``problem``, once both are open: the
    one judgement :func:`verify_file` makes of files and :mod:`maskln_cli.testing` of tensors
    in memory (``result`` is then anything that reads as a :class:`TensorFile` does: ``name``,
    ``keys``, ``in``, ``info`` and ``tensor``). ``problem`` holds scale and bias in float64."""
    check_options(verify)
    if not problem.norm.centered:
        problem = _as_rms_view(problem)
    valid_rows = int(problem.valid.sum())
    nonfinite_rows = problem.nonfinite_valid_rows()
    if verify.plain_layer_norm:
        problem, mask = _as_plain_layer_norm(problem, mask)
    plan = Plan(problem, result, options, verify)
    plan.valid_rows = valid_rows  # the op's valid rows, also where every row is normalized
    _suggest_valid_key(plan, options)
    if mask is not None and mask.left_out == mask.rows:
        _refuse_comparing_nothing(plan, mask)
    job = _Job(plan, mask, options.chunk_rows, nonfinite_rows)
    return job.run(progress)


def _as_rms_view(problem: Problem) -> Problem:
    """An RMSNorm problem as verify's parts take it: ``scale`` its whole gain (offset + scale:
    grad_scale is the same), ``bias`` zeros (its sums over rows are computed, never judged),
    and the norm, which picks RMSNorm's truth, yardstick and budget model (no mean)."""
    import torch

    gain = problem.scale.double() + problem.offset
    bias = torch.zeros(problem.channels, dtype=torch.float64)
    return dataclasses.replace(problem, scale=gain, bias=bias, offset=0.0)


def _as_plain_layer_norm(problem: Problem, mask: RowMask | None) -> tuple[Problem, RowMask]:
    """--plain-layer-norm: the reference normalizes every row, as a plain LayerNorm does (its
    gradient sums over rows take the padding's too), and only the op's valid rows (and those
    --valid keeps) are compared."""
    import torch

    keep = problem.valid if mask is None else problem.valid & mask.keep
    source = "--plain-layer-norm (INPUT's valid rows)"
    if mask is not None:
        source = f"--valid {mask.source} and {source}"
    leading = tuple(problem.shape[:-1])
    plain = dataclasses.replace(problem, valid=torch.ones_like(problem.valid))
    return plain, RowMask(source, leading, keep)


def _suggest_valid_key(plan: Plan, options: NormalizeOptions) -> None:
    """INPUT holds no mask under --valid-key's name, yet a 0/1 integer or bool tensor of x's
    leading shape: say which option reads it (a note, next to 'every position is valid')."""
    if options.valid_key is not None or not any("every position is valid" in n for n in plan.notes):
        return
    data = plan.problem.input_file
    hint = valid_key_hint(data, tuple(plan.problem.shape[:-1])) if data is not None else None
    if hint is not None:
        plan.notes.append(hint)


def _refuse_comparing_nothing(plan: Plan, mask: RowMask) -> None:
    """A mask that leaves out every row leaves nothing of out or grad_x to compare: a verdict
    on nothing is no pass (a missing tensor is not one either)."""
    rows = [name for name in plan.names if name in ROW_TENSORS]
    if rows:
        raise MasklnError(
            f"--valid {mask.source}: leaves out every one of its {mask.rows:,} rows, so nothing"
            f" of {', '.join(rows)} would be compared; give a mask with valid rows (or leave"
            " --valid out)"
        )


class _Job:
    """The verification of one RESULT against one INPUT: the plan, one streaming pass, words."""

    def __init__(
        self, plan: Plan, mask: RowMask | None, chunk_rows: int | None, nonfinite_x_rows: int = 0
    ) -> None:
        self.plan = plan
        self.mask = mask
        self.nonfinite_x_rows = nonfinite_x_rows  # valid rows of x holding NaN or inf
        # RMSNorm's budget is its model alone (calibrated so: tests/verify/test_rms_budget.py):
        # F.rms_norm in float32 overflows on rows above 1.8e19, and its error there (its output
        # is 0) would raise those rows' budget to 1.
        raises = YARDSTICK_RAISES and plan.problem.norm.centered
        self.measuring = StreamingPass(plan, mask, chunk_rows, raises)

    def run(self, progress: Progress | None) -> ComparisonReport:
        plan = self.plan
        comparing = {c.name: c for c in plan.checked if c.comparison is not None}
        live = {n: c for n, c in comparing.items() if c.comparison.comparable}  # type: ignore[union-attr]
        self.measuring.run(live, progress)
        explainer = Explainer(plan, self.measuring.poisoned, self.measuring.fits, self.mask)
        # Explained in the order out, grad_x, grad_scale, grad_bias (an earlier tensor's
        # explanation is tried first on later ones), reported in the plan's. On one thread:
        # a diagnosis's work is small (a sample of rows), and on a busy machine torch's
        # threads made each of its operations take tens of milliseconds instead of one.
        with one_thread():
            for checked in sorted(plan.checked, key=lambda c: TENSORS.index(c.name)):
                if checked.comparison is not None:
                    checked.outcome = checked.comparison.result(compared=checked.name in live)
                    if (
                        self.mask is not None
                        and checked.name in live
                        and checked.name in ROW_TENSORS
                    ):
                        count_left_out(checked.outcome, self.mask.left_out)
                    explainer.describe(checked)
                elif checked.outcome is not None and checked.outcome.problems:
                    checked.outcome.explanation = checked.outcome.problems[0]
        tensors = [checked.outcome for checked in plan.checked]
        if self.mask is not None:
            mask = self.mask
            compared = ", ".join(n for n in ROW_TENSORS if n in live) or "nothing"
            # --plain-layer-norm's mask names itself (and --valid's, when both are given).
            label = mask.source if mask.source.startswith("--") else f"--valid {mask.source}"
            plan.notes.append(
                f"{label}: compared {mask.rows - mask.left_out:,} of"
                f" {mask.rows:,} rows of {compared}"
            )
        tensors += plan.unchecked()
        context = plan.context()
        not_checked = self._not_checked(live) + explainer.not_checked
        context["nonfinite_x_rows"] = self.nonfinite_x_rows
        if not_checked:
            context["not_checked"] = not_checked
        return ComparisonReport(
            "verify", plan.result.name, plan.problem.source, tensors, plan.notes, context
        )

    def _not_checked(self, live: dict[str, Checked]) -> list[str]:
        """What no comparison of these tensors can show, in words (for the verdict line)."""
        if live and self.plan.valid_rows == 0:  # every tensor is 0 whatever a kernel computes
            return ["no row is valid: only the padding was checked, no normalized value"]
        found = []
        if self.plan.problem.channels == 1 and ("out" in live or "grad_x" in live):
            found.append(
                "C = 1: out is the bias alone (every normalized value is 0), so no"
                " normalization mistake can show"
            )
        if live and self.nonfinite_x_rows:
            found.append(self._nonfinite_x_words(live))
        return found

    def _nonfinite_x_words(self, live: dict[str, Checked]) -> str:
        """Valid rows whose x holds NaN or inf: the truth is NaN there (its mean and variance
        are), so RESULT was only checked to be NaN too, in those rows (and in grad_scale's
        every channel, which sums over them)."""
        plan = self.plan
        rows = [n for n in ("out", "grad_x") if n in live]
        where = f"{' and '.join(rows)} only checked to be NaN there" if rows else ""
        if "grad_scale" in live:
            sums = "grad_scale only checked to be NaN (it sums over those rows)"
            where = f"{where}, and {sums}" if where else sums
        return (
            f"{self.nonfinite_x_rows:,} of {plan.valid_rows:,} valid rows hold NaN or inf in x:"
            f" the truth is NaN there, so RESULT's {where}"
        )
