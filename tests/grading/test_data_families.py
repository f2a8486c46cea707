"""Data that finds mistakes (issue 32, item 1): every clause draws from a catalogue of data
families (constant rows, exact zeros, eps from 1e-12 to 10, C = 1 and a prime C, strided
upstream gradients), a failing clause names the family in its detail, and each wrong solution
that random data let pass (tests/solutions/data_families.py, three ways each) now fails, with
its cause named. In process, the clauses concerned only."""

from __future__ import annotations

import pytest

from maskln_cli.grading.clauses import CLAUSES
from maskln_cli.grading.clauses.families import (
    CONSTANT,
    EPS,
    FAMILIES,
    ONE_CHANNEL,
    PRIME,
    UPSTREAM,
    ZEROS,
    family_of,
)
from maskln_cli.grading.runner import grade
from tests.solutions import data_families

# Each wrong solution: the family that fails it, the clause that shows it first, its cause.
FALSE_PASSES = {
    "constant_rows_where_zero": (CONSTANT, "gradients", "gradient_lost_at_zero_variance"),
    "constant_rows_guarded_backward": (CONSTANT, "gradients", "gradient_lost_at_zero_variance"),
    "constant_rows_loop_skips": (CONSTANT, "gradients", "gradient_lost_at_zero_variance"),
    "zeros_counted_out_ne": (ZEROS, "values", "zeros_taken_as_padding"),
    "zeros_counted_out_count_nonzero": (ZEROS, "values", "zeros_taken_as_padding"),
    "zeros_counted_out_loop": (ZEROS, "values", "zeros_taken_as_padding"),
    "eps_floored": (EPS, "values", "eps_floored"),
    "rstd_clamped": (EPS, "values", "eps_floored"),
    "denominator_clamped": (EPS, "values", "eps_floored"),
    "std_from_vector_norm": (ONE_CHANNEL, "second_order", "nan_at_zero_variance"),
    "variance_from_norm_squared": (ONE_CHANNEL, "second_order", "nan_at_zero_variance"),
    "variance_from_pairwise_distance": (ONE_CHANNEL, "second_order", "nan_at_zero_variance"),
    "std_by_hypot": (CONSTANT, "gradients", "nan_at_zero_variance"),
    "upstream_view": (UPSTREAM, "gradients", "view_on_strided"),
    "upstream_as_strided": (UPSTREAM, "gradients", "upstream_read_as_contiguous"),
    "upstream_numpy_buffer": (UPSTREAM, "gradients", "upstream_read_as_contiguous"),
}
CONCERNED = ["values", "gradients", "second_order"]


@pytest.mark.parametrize("name", FALSE_PASSES)
def test_each_former_false_pass_fails_on_its_family_with_its_cause(name):
    family, clause, cause = FALSE_PASSES[name]
    strict = clause == "second_order"  # a strict clause: counted here as a handout counts it
    report = grade(getattr(data_families, name), only=CONCERNED if strict else CONCERNED[:2])
    assert not report.passed, report.text()
    failing = {c.name: c for c in report.clauses if not c.passed}
    assert clause in failing, report.text()
    assert failing[clause].detail.startswith(f"[{family}] "), failing[clause].detail
    assert report.root_cause is not None and report.root_cause.mistake == cause, report.text()


def _channels(clause: str) -> set[int]:
    cases = CLAUSES[clause].build(0)
    return {case.inputs()["x"].shape[-1] for case in cases if case.x.dim()}


# The worked example is the specification's; the accuracy clauses' rows are their own family.
FIXED = {"worked_example", "two_pass", "offset_accuracy", "half_values", "half_gradients"}


@pytest.mark.parametrize("clause", [name for name in CLAUSES if name not in FIXED])
def test_every_clause_tries_one_channel_and_a_prime_count(clause):
    channels = _channels(clause)
    assert 1 in channels, channels
    assert any(c > 2 and all(c % d for d in range(2, c)) for c in channels), channels


@pytest.mark.parametrize("clause", list(CLAUSES))
def test_every_case_names_its_family(clause):
    for case in CLAUSES[clause].build(0):
        assert family_of(case.label) in FAMILIES, case.label
        assert family_of(case.label) == case.family


def test_the_data_families_are_drawn():
    values = CLAUSES["values"].build(0)
    by_family = {family: [c for c in values if c.family == family] for family in FAMILIES}
    constant = by_family[CONSTANT][0]
    rows = constant.x.reshape(-1, constant.x.shape[-1])
    assert any(bool((row == row[0]).all()) and row[0] != 0 for row in rows)
    zeros = by_family[ZEROS][0].x
    assert 0.2 < float((zeros == 0).double().mean()) < 0.9
    assert {c.eps for c in by_family[EPS]} == {1e-12, 1e-8, 1e-5, 0.1, 3.0, 10.0}
    for case in by_family[EPS]:  # variances around eps, where eps decides the result
        clean = case.x.double().reshape(-1, case.x.shape[-1])
        ratio = clean.var(-1, unbiased=False) / case.eps
        assert float(ratio.min()) < 0.1 and float(ratio.max()) > 10, case.label
    gradients = [c for c in CLAUSES["gradients"].build(0) if c.family == UPSTREAM]
    layouts = {c.label.rpartition("the upstream gradient ")[2] for c in gradients}
    assert len(layouts) == 5, layouts
    for case in gradients:
        grad_out = case.inputs()["grad_out"]
        assert grad_out.shape == case.x.shape and grad_out.dim() == 3
        assert not grad_out.is_contiguous() or 0 in grad_out.stride(), case.label
    assert PRIME in {c.family for c in values} and ONE_CHANNEL in {c.family for c in values}


def test_a_correct_float32_kernel_whose_mean_rounds_passes_rows_of_zero_variance():
    """Rows of zero variance in float32 (C = 1, constant rows) use eps 0.1: a mean computed as
    a product with 1 / C, which rounds, is divided by sqrt(eps) there (at 1e-5, 300 times)."""
    from tests.solutions.variants import matmul_means

    report = grade(matmul_means, only=["values", "large_shapes", "gradients", "leading_axes"])
    assert report.passed, report.text()


@pytest.mark.parametrize("clause", list(CLAUSES))
def test_every_constant_rows_case_holds_a_valid_constant_row(clause):
    """A constant-rows case whose mask leaves out every constant row checks nothing of that
    family: with --seed 4, the second_order clause's did (one of 11,040 cases over seeds 0 to
    39, before families.mask_for)."""
    for seed in range(8):
        for case in CLAUSES[clause].build(seed):
            if case.family != CONSTANT or not case.valid.any():
                continue
            t = case.inputs()
            rows = t["x"].reshape(-1, t["x"].shape[-1])
            valid = t["valid"].reshape(-1)
            assert ((rows == rows[:, :1]).all(-1) & valid).any(), (seed, case.label)
