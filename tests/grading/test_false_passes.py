"""No false passes (issue 22): wrong solutions that passed every required clause before the
clauses tried their case: values under no_grad and inference_mode; every row invalid with NaN
and inf in the padding; a 0-d valid or one row, poisoned. Each fails (the verdict is FAIL) on
the clause that checks what it gets wrong. In process, the relevant clauses only."""

from __future__ import annotations

import pytest

from maskln_cli.grading.runner import grade
from tests.solutions import false_passes

CLAUSES = [
    "values",
    "leading_axes",
    "invalid_rows_zero",
    "sanitized_padding",
    "sanitized_gradients",
]

# Each wrong solution, and the clauses it fails among CLAUSES.
FALSE_PASSES = {
    "no_grad_path_forgets_mask": {"values", "sanitized_padding"},
    "inference_mode_path_unbiased": {"values", "sanitized_padding"},
    "eval_path_eps_outside_sqrt": {"values", "sanitized_padding"},
    "all_invalid_times_zero": {"sanitized_padding", "sanitized_gradients"},
    "all_invalid_x_minus_x": {"sanitized_padding", "sanitized_gradients"},
    "all_invalid_skips_sanitizing": {"sanitized_padding", "sanitized_gradients"},
    "vector_path_multiplies_by_flag": {"sanitized_padding", "sanitized_gradients"},
    "vector_path_selects_unsanitized": {"sanitized_gradients"},
    "single_row_path_scales_by_mask": {"sanitized_padding", "sanitized_gradients"},
}


@pytest.mark.parametrize("name", FALSE_PASSES)
def test_each_former_false_pass_fails_its_clause(name):
    report = grade(getattr(false_passes, name), only=CLAUSES)
    failing = {c.name for c in report.clauses if not c.passed}
    assert failing == FALSE_PASSES[name], report.text()
    assert not report.passed
    assert report.root_cause is not None  # a known mistake names it: NaN from the padding, ...


def test_values_say_which_grad_mode_was_wrong():
    report = grade(false_passes.no_grad_path_forgets_mask, only=["values"])
    (values,) = report.clauses
    assert "no_grad" in values.detail or "inference_mode" in values.detail, values.detail
    assert report.root_cause.mistake == "padding_returns_bias"


def test_poisoned_shape_families_are_tried_under_grad_on_and_off():
    """The cases of sanitized_padding: 0-d valid, all invalid, all valid, empty and one row, each
    with NaN, inf and 1e30 in every invalid row, called with grad on and off."""
    from maskln_cli.grading.clauses import CLAUSES as ALL

    clause = ALL["sanitized_padding"]
    cases = clause.build(0)
    labels = " | ".join(case.label for case in cases)
    assert any(case.valid.dim() == 0 and not bool(case.valid) for case in cases), labels
    assert any(case.valid.numel() > 1 and not bool(case.valid.any()) for case in cases), labels
    assert any(case.valid.numel() > 1 and bool(case.valid.all()) for case in cases), labels
    assert any(case.valid.numel() == 0 for case in cases), labels
    assert any(case.valid.numel() == 1 and case.valid.dim() > 0 for case in cases), labels
    for case in cases:
        padding = case.x[~case.valid] if case.valid.dim() else case.x[None][~case.valid[None]]
        if padding.numel():
            poisoned = ~padding.isfinite() | (padding.abs() >= 1e30)
            assert bool(poisoned.all()), case.label  # every invalid row, wholly
            if case.valid.numel() <= 1 and "1e30 throughout" not in case.label:  # a lone row mixes
                assert bool(padding.isnan().any()) and bool(padding.isinf().any()), case.label
    from maskln_cli.grading.clauses import padding

    modes = {call.mode for call in padding._sanitized_padding_calls(cases)}
    assert modes == {"grad", "no_grad", "inference"}
