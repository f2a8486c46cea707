"""Coverage for kernel authors (issue 22): kernels wrong only at a realistic size (a warp, a
block of channels, a grid of rows) fail large_shapes; kernels wrong only in half precision fail
the opt-in half clauses; correct half-precision kernels pass them. In process, few clauses each."""

from __future__ import annotations

import pytest

from maskln_cli.grading.clauses import CLAUSES
from maskln_cli.grading.runner import grade
from tests.solutions import correct, kernel_bugs, variants

# Each kernel, and the clauses it fails among those graded here.
KERNEL_BUGS = {
    "backward_wrong_past_a_warp": {"large_shapes"},
    "statistics_of_one_block": {"large_shapes"},
    "rows_past_the_grid_left_zero": {"large_shapes"},
}
HALF_BUGS = {
    "unbiased_in_half_precision": {"half_values", "half_gradients"},
}


def failed(report) -> set[str]:
    return {c.name for c in report.clauses if not c.passed}


@pytest.mark.parametrize("name", KERNEL_BUGS)
def test_kernels_wrong_only_at_realistic_sizes_fail_large_shapes(name):
    report = grade(getattr(kernel_bugs, name), only=["values", "gradients", "large_shapes"])
    assert failed(report) == KERNEL_BUGS[name], report.text()
    detail = next(c.detail for c in report.clauses if c.name == "large_shapes")
    assert "gave" in detail and "the reference gives" in detail  # a counterexample, in words


def test_a_backward_wrong_past_a_warp_fails_on_its_gradients():
    report = grade(kernel_bugs.backward_wrong_past_a_warp, only=["large_shapes"])
    (clause,) = report.clauses
    assert "grad_x" in clause.detail and "requiring grad" in clause.detail


def test_large_shapes_are_realistic():
    """C of 8,192, 4,095 and 1,000 (gradients too), and more than 4,096 rows."""
    cases = CLAUSES["large_shapes"].build(0)
    widths = {case.x.shape[-1] for case in cases}
    assert {8192, 4095, 1000} <= widths
    assert max(case.valid.numel() for case in cases) > 4096


@pytest.mark.parametrize("name", HALF_BUGS)
def test_kernels_wrong_only_in_half_precision_fail_the_half_clauses(name):
    fn = getattr(kernel_bugs, name)
    default = grade(fn, only=["values", "dtypes", "large_shapes"])
    assert default.passed  # right in float32 and float64: only the opt-in group sees it
    report = grade(fn, only=["half_values", "half_gradients"])
    assert failed(report) == HALF_BUGS[name], report.text()
    assert report.root_cause is not None and report.root_cause.mistake == "unbiased_variance"


@pytest.mark.parametrize(
    "fn",
    [correct.masked_layer_normalization, kernel_bugs.correct_with_float32_accumulation,
     kernel_bugs.half_arithmetic, variants.var_mean],
    ids=lambda fn: fn.__name__,
)  # fmt: skip
def test_correct_half_precision_kernels_pass_the_half_clauses(fn):
    report = grade(fn, only=["half_values", "half_gradients"])
    assert report.passed, report.text()


def test_half_clauses_run_only_when_asked_for():
    report = grade(correct.masked_layer_normalization, only=["signature"], include=["half"])
    assert [c.name for c in report.clauses] == ["signature", "half_values", "half_gradients"]
    assert all(c.level == "optional" for c in report.clauses[1:])
    assert "half_values" not in {c.name for c in grade(correct.masked_layer_normalization).clauses}
