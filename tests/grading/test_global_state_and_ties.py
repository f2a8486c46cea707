"""Issue 38 (maskln grade, round four), item 2, in process: no false pass from torch's global state
left changed (grad mode, threads), whatever the caller's state, nor from a second derivative
wrong only at exact ties. The solutions are tests/solutions/round_four.py."""

from __future__ import annotations

import pytest

from maskln_cli.grading.runner import grade
from tests.solutions import round_four

# --- item 2: false passes from global state and exact ties ---------------------------------------


@pytest.mark.parametrize(
    ("name", "words"),
    [("grad_mode_left_on", "grad mode"), ("threads_left_at_one", "threads")],
)
def test_global_state_left_changed_fails_whatever_the_callers_state(name, words):
    report = grade(getattr(round_four, name), only=["no_global_effects"])
    (clause,) = report.clauses
    assert not clause.passed, report.text()
    assert words in clause.detail, clause.detail
    assert report.root_cause is not None and report.root_cause.mistake == "global_state_changed"


def test_a_second_derivative_wrong_only_at_exact_ties_fails():
    report = grade(round_four.abs_pow_variance, only=["second_order"])
    (clause,) = report.clauses
    assert not clause.passed, report.text()
    assert clause.detail.startswith("[exact ties]"), clause.detail


def test_the_exact_ties_family_holds_every_kind_of_tie():
    """Valid rows with elements equal to the row's mean, equal elements, and zero deviations in
    a row that is not constant: exactly, in float64 and float32 alike."""
    import torch

    from maskln_cli.grading.clauses import CLAUSES

    (case,) = [c for c in CLAUSES["second_order"].build(0) if c.family == "exact ties"]
    rows = case.x.reshape(-1, case.x.shape[-1])[case.valid.reshape(-1)]
    assert len(rows) >= 2
    for row in rows:
        mean = row.sum() / row.numel()
        assert bool((row == mean).any()) and not bool((row == mean).all())
        assert len(torch.unique(row)) < row.numel()  # equal elements
        assert bool((row.float() == mean.float()).any())  # float32 too


# --- false passes found by the class of round four (tests/solutions/class_round_four/) ----------


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("deterministic_set_off_after", "deterministic"),
        ("anomaly_set_off_after", "anomaly"),
    ],
)
def test_a_mode_set_off_after_the_call_fails_from_a_caller_that_had_it_on(name, words):
    """Setting a mode off "back" is invisible from the grader's usual state, where it is off."""
    report = grade(getattr(round_four, name), only=["no_global_effects"])
    (clause,) = report.clauses
    assert not clause.passed, report.text()
    assert words in clause.detail, clause.detail


def test_an_affine_skipped_when_it_is_the_identity_fails_gradients():
    """scale = 1 and bias = 0, as a module initializes them, are a data family of gradients."""
    report = grade(round_four.affine_skipped_when_identity, only=["gradients"])
    (clause,) = report.clauses
    assert not clause.passed, report.text()
    assert clause.detail.startswith("[identity affine]"), clause.detail
