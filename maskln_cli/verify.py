"""``maskln verify``: recompute from INPUT as ``maskln normalize`` would, compare with EXPECTED.

Results are compared chunk by chunk as they are computed, so nothing full-size is held in
memory. ``actual`` is maskln's recomputation, ``expected`` is the EXPECTED file (for example a
kernel's output): the tolerance is relative to EXPECTED's values, and EXPECTED's ``out`` and
``grad_x`` must be exactly 0 at every invalid position.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from maskln_cli.compare import (
    Comparison,
    ComparisonReport,
    TensorComparison,
    check_tolerance,
    missing,
)
from maskln_cli.errors import MasklnError
from maskln_cli.normalize import (
    GRADIENT_KEYS,
    GradientSums,
    NormalizeOptions,
    Problem,
    Progress,
    iter_gradients,
    iter_outputs,
    load_problem,
)
from maskln_cli.tensorfile import STDIO, TensorFile, open_tensor_file
from maskln_cli.validrows import RowMask, count_left_out, leave_out, open_row_mask, parse_mask_spec

if TYPE_CHECKING:
    import torch


def verify_file(
    input_path: str,
    expected_path: str,
    options: NormalizeOptions | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    progress: Progress | None = None,
    valid_rows: str | None = None,
) -> ComparisonReport:
    """Compare maskln's result for INPUT with EXPECTED: ``out``, and the gradients that
    EXPECTED holds when INPUT holds ``grad_out``. With ``valid_rows`` (``FILE[:KEY]``, a mask
    of x's leading shape) only the rows it marks valid are compared.

    Example:
        >>> report = verify_file("sample_data/pair_features.safetensors",
        ...                      "sample_data/pair_features_expected.safetensors")
        >>> report.passed, [t.name for t in report.tensors]
        (True, ['out', 'grad_x', 'grad_scale', 'grad_bias'])
    """
    options = options or NormalizeOptions()
    check_tolerance(rtol, "--rtol")
    check_tolerance(atol, "--atol")
    if input_path == STDIO and expected_path == STDIO:
        raise MasklnError("INPUT and EXPECTED cannot both be '-' (stdin)")
    if valid_rows is not None and parse_mask_spec(valid_rows)[0] == STDIO:
        raise MasklnError("--valid: give a file (stdin carries INPUT or EXPECTED)")
    with contextlib.ExitStack() as stack:
        problem = stack.enter_context(load_problem(input_path, options))
        expected = stack.enter_context(open_tensor_file(expected_path))
        notes = list(problem.notes)
        mask = stack.enter_context(open_row_mask(valid_rows)) if valid_rows else None
        if mask is not None and not mask.applies_to(problem.shape):
            raise MasklnError(
                f"--valid: {mask.source} has shape {list(mask.shape)}; expected x's leading"
                f" shape {list(problem.shape[:-1])}"
            )
        gradient_keys = [k for k in GRADIENT_KEYS if k in expected]
        check_gradients = problem.grad_out is not None and bool(gradient_keys)
        if problem.grad_out is None and gradient_keys:
            notes.append(
                f"{expected.name} holds {', '.join(gradient_keys)} but the input has no"
                " 'grad_out': gradients were not checked"
            )
        elif problem.grad_out is not None and not gradient_keys:
            notes.append(
                f"{expected.name} holds no grad_x, grad_scale or grad_bias: only"
                f" {options.out_key!r} was checked"
            )
        total = problem.rows * (2 if check_gradients else 1)
        out_key = options.out_key
        tensors = [_compare_out(problem, expected, out_key, rtol, atol, progress, total, mask)]
        if check_gradients:
            tensors += _compare_gradients(
                problem, expected, gradient_keys, rtol, atol, progress, total, mask
            )
        if mask is not None:
            compared = ", ".join(t.name for t in tensors if t.rows_left_out is not None)
            notes.append(
                f"--valid {mask.source}: compared {mask.rows - mask.left_out:,} of"
                f" {mask.rows:,} rows of {compared or 'nothing'}"
            )
        report = ComparisonReport("verify", problem.source, expected.name, tensors, notes)
        report.eps, report.eps_source = problem.eps, problem.eps_source
        return report


def _chunk(
    out: torch.Tensor, expected: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's two sides and its invalid rows, with the rows ``keep`` (``--valid``) leaves
    out set to 0 on both sides and not counted as invalid."""
    if keep is None:
        return out, expected, ~valid
    out, expected = leave_out(out, expected, keep)
    return out, expected, ~valid & keep


def _comparison(
    problem: Problem,
    expected: TensorFile,
    key: str,
    shape: tuple[int, ...],
    rtol: float | None,
    atol: float | None,
) -> Comparison:
    """A running comparison of maskln's ``key`` (of ``shape``) against EXPECTED's."""
    info = expected.info(key)
    return Comparison(key, shape, problem.dtype_name, info.shape, info.dtype, rtol, atol)


def _compare_out(
    problem: Problem,
    expected: TensorFile,
    key: str,
    rtol: float | None,
    atol: float | None,
    progress: Progress | None,
    total: int,
    mask: RowMask | None = None,
) -> TensorComparison:
    if key not in expected:
        held = ", ".join(repr(k) for k in expected.keys()[:5]) or "nothing"
        hint = f" (it holds {held}; --out-key names the result)"
        return missing(key, "expected", problem.shape, problem.dtype_name, hint)
    comparison = _comparison(problem, expected, key, problem.shape, rtol, atol)
    if comparison.comparable:
        rows = expected.tensor(key).reshape(-1, problem.channels)
        for start, stop, out in iter_outputs(problem):
            keep = mask.keep[start:stop] if mask else None
            a, e, invalid = _chunk(out, rows[start:stop], problem.valid[start:stop], keep)
            comparison.update(a, e, invalid_rows=invalid)
            if progress:
                progress(stop, total)
    outcome = comparison.result()
    if mask is not None and comparison.comparable:
        count_left_out(outcome, mask.left_out)
    if outcome.expected_dtype in ("float32", "float64") and outcome.dtype != outcome.expected_dtype:
        outcome.problems = [
            f"{p} (--dtype {outcome.expected_dtype} computes in it)" if p.startswith("dtype") else p
            for p in outcome.problems
        ]
    return outcome


def _compare_gradients(
    problem: Problem,
    expected: TensorFile,
    keys: list[str],
    rtol: float | None,
    atol: float | None,
    progress: Progress | None,
    total: int,
    mask: RowMask | None = None,
) -> list[TensorComparison]:
    """Compare the gradients EXPECTED holds (``keys``); one pass computes all three."""
    grad_x = None
    if "grad_x" in keys:
        grad_x = _comparison(problem, expected, "grad_x", problem.shape, rtol, atol)
    rows = None
    if grad_x is not None and grad_x.comparable:
        rows = expected.tensor("grad_x").reshape(-1, problem.channels)
    sums = GradientSums(problem)
    for start, stop, chunk in iter_gradients(problem, sums):
        if grad_x is not None and rows is not None:
            keep = mask.keep[start:stop] if mask else None
            a, e, invalid = _chunk(chunk, rows[start:stop], problem.valid[start:stop], keep)
            grad_x.update(a, e, invalid_rows=invalid)
        if progress:
            progress(problem.rows + stop, total)
    outcomes = [grad_x.result()] if grad_x is not None else []
    if outcomes and mask is not None and rows is not None:
        count_left_out(outcomes[0], mask.left_out)
    for key, total_sum in (("grad_scale", sums.scale), ("grad_bias", sums.bias)):
        if key in keys:
            comparison = _comparison(problem, expected, key, (problem.channels,), rtol, atol)
            if comparison.comparable:
                comparison.update(total_sum.to(problem.dtype), expected.tensor(key))
            outcomes.append(comparison.result())
    return outcomes
