"""One root cause, in words a student can act on (issue 22): the report leads with the one known
mistake that explains the failing clauses, marks the clauses failing only through it, names dtype
and precision mistakes, prefers no_reinit's cause to "bias not added", prints numbers that never
look equal when they differ, and gives positive_zero a fix. In process."""

from __future__ import annotations

import pytest
import torch

from maskln_cli.grading.clauses.judging import format_pair
from maskln_cli.grading.report import NO_MATCH, diagnosis_lines
from maskln_cli.grading.runner import grade
from tests.solutions import broken, mistakes, precision


def test_the_report_leads_with_the_one_mistake_that_explains_every_failing_clause():
    report = grade(mistakes.unbiased_variance)
    failing = [c for c in report.clauses if c.counted and not c.passed]
    assert len(failing) > 5  # one mistake, many clauses
    lines = report.text().splitlines()
    assert lines[1] == (
        f"root cause: one mistake explains all {len(failing)} failing clauses, and 3 failing"
        " strict clauses not counted"
    )
    assert lines[2] == "  unbiased variance (divides by C - 1)"
    assert lines[3].startswith("  fix: use the population variance")
    assert report.root_cause.clause == "values"
    assert {c.cause for c in failing if c.name != "values"} == {"values"}
    assert "same cause as values" in report.text()
    assert diagnosis_lines(report) == []  # said once, at the top; no "matches none..." after it


def test_an_unbiased_variance_guarded_at_c_1_is_still_named():
    """Right at C = 1 (max(C - 1, 1)), so the C = 1 cases it passes once refuted the formula,
    which is NaN there: 3 of 10 failing clauses were explained, the others "none of the known
    mistakes" (a new user's trial). An undefined formula now says nothing on such a case."""
    report = grade(mistakes.unbiased_variance_guarded)
    failing = [c.name for c in report.clauses if c.counted and not c.passed]
    assert report.root_cause is not None, report.text()
    assert report.root_cause.mistake == "unbiased_variance", report.text()
    assert {"values", "large_shapes", "leading_axes", "gradients", "strided_inputs"} <= set(
        report.root_cause.explains
    ), report.text()
    assert len(report.root_cause.explains) >= len(failing) - 1, report.text()


# Each dtype or parameter mistake, and the root cause the report names.
ROOT_CAUSES = {
    "output_hard_coded_float32": "output_float32",
    "float64_computed_in_float32": "computed_in_float32",
    "float32_computed_in_float64": "float64_not_cast_back",
    "computed_in_float16": "computed_in_float16",
    "reinitializes_parameters": "parameters_reinitialized",
    "zeroes_bias_in_place": "parameters_reinitialized",
}


@pytest.mark.parametrize("name", ROOT_CAUSES)
def test_dtype_and_parameter_mistakes_are_named_as_the_root_cause(name):
    report = grade(getattr(precision, name))
    assert not report.passed
    assert report.root_cause is not None, report.text()
    assert report.root_cause.mistake == ROOT_CAUSES[name], report.text()
    counted = [c.name for c in report.clauses if c.counted and not c.passed]
    assert set(counted) <= set(report.root_cause.explains), report.text()
    assert NO_MATCH not in report.text()
    if ROOT_CAUSES[name] == "parameters_reinitialized":
        assert "add bias after scaling" not in report.text()  # the wrong advice


def test_two_different_numbers_never_read_the_same():
    gave, expected = -1.0396132, -1.0396130
    text = format_pair(gave, expected, torch.float32)
    shown = text.removeprefix("gave ").split(", the reference gives ")
    assert shown[0] != shown[1].split(" (")[0]
    assert "float32 ulps apart" in text


def test_clause_details_never_show_equal_numbers_for_a_failure():
    """float64 computed in float32: the counterexamples differ beyond the 7th digit."""
    report = grade(precision.float64_computed_in_float32, only=["values", "dtypes"])
    for clause in report.clauses:
        if clause.detail and " gave " in clause.detail:
            gave, _, rest = clause.detail.partition(" gave ")[2].partition(", the reference gives ")
            assert gave != rest.split(" ")[0], clause.detail


def test_positive_zero_suggests_a_fix():
    report = grade(broken.zeroes_by_multiplying, only=["positive_zero"])
    assert report.root_cause.mistake == "negative_zero"
    assert "torch.where(valid[..., None], y, 0.0)" in report.root_cause.fix


def test_the_worked_example_names_the_one_mistake_that_explains_it():
    report = grade(mistakes.eps_outside_sqrt, only=["worked_example"])
    (clause,) = report.clauses
    assert [d["mistake"] for d in clause.diagnosis] == ["eps_outside_sqrt"]
