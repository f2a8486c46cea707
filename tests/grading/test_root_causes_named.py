"""The root cause named right (issue 32, item 3): each mistake the grader named wrongly or
vaguely before (tests/solutions/root_causes.py) leads its report with its own cause, in words
a student can act on. In process."""

from __future__ import annotations

import pytest
import torch

from maskln_cli.grading.clauses import CLAUSES
from maskln_cli.grading.clauses.rows import sign_of_multiplied_zeros
from maskln_cli.grading.runner import grade
from tests.solutions import root_causes

# Each solution, the root cause it must get, and words its description must hold.
NAMED = {
    "stale_mask_cache": ("stale_mask", "a mask kept from an earlier call"),
    "inverted_mask": ("mask_inverted", "the mask read the other way round"),
    "eps_squared": ("eps_squared", "eps squared"),
    "unbiased_rescaled": ("unbiased_rescaled", "at C = 1"),
    "mean_over_valid_rows": ("statistics_over_valid_rows", "number of valid positions"),
    "mean_over_whole_tensor": ("statistics_over_whole_tensor", "whole tensor"),
    "empty_like_output": ("output_uninitialized", "never written"),
    "eps_as_float32_tensor": ("eps_float32", "float32 tensor"),
    "mask_not_unsqueezed": ("broadcasting_error", "valid[..., None]"),
    "float32_work_buffer": ("dtype_error", "dtype=x.dtype"),
    "once_differentiable_backward": ("backward_not_differentiable", "@once_differentiable"),
    "backward_from_saved_values": ("backward_from_saved_values", "values saved in the forward"),
}
# The second-order ones fail a strict clause only: counted as a handout counts it.
SECOND_ORDER = {"once_differentiable_backward", "backward_from_saved_values"}


@pytest.mark.parametrize("name", NAMED)
def test_each_mistake_leads_its_report_with_its_cause(name):
    mistake, words = NAMED[name]
    include = ["second_order"] if name in SECOND_ORDER else []
    report = grade(getattr(root_causes, name), include=include)
    assert not report.passed
    assert report.root_cause is not None, report.text()
    assert report.root_cause.mistake == mistake, report.text()
    assert words in report.root_cause.description, report.root_cause.description
    counted = [c.name for c in report.clauses if c.counted and not c.passed]
    explained = set(report.root_cause.explains)
    # The cause explains the failures, nearly all of them (a broadcasting error can pass
    # silently where the two axes happen to have one length).
    assert len(explained & set(counted)) >= len(counted) - 1, report.text()


def test_second_order_failures_are_said_in_words_not_gradgradcheck_tensors():
    report = grade(root_causes.backward_from_saved_values, only=["second_order"])
    (clause,) = report.clauses
    assert "numerical:" not in clause.detail and "analytical:" not in clause.detail
    assert "the numerical and analytical second derivatives differ" in clause.detail


def test_a_stale_mask_says_whose_mask_it_was():
    report = grade(root_causes.stale_mask_cache, only=["values"])
    (found,) = report.clauses[0].diagnosis
    assert found["mistake"] == "stale_mask"
    assert "here the mask of an earlier call, [" in found["description"]


def test_negative_zeros_not_where_a_multiplication_puts_them_are_uninitialized_memory():
    (case, *_) = CLAUSES["positive_zero"].build(0)
    t = case.inputs()
    keep = t["valid"][..., None]
    multiplied = (t["x"] * 0 + t["bias"]) * keep  # bias < 0: -0.0 at every invalid element
    assert sign_of_multiplied_zeros(case, multiplied)
    garbage = torch.where(keep, multiplied, 0.0)
    invalid = (~keep).expand_as(garbage).clone()
    invalid.view(-1)[invalid.view(-1).nonzero()[::3]] = False  # -0.0 at two in three only
    garbage = torch.where(invalid, -0.0, garbage)
    assert not sign_of_multiplied_zeros(case, garbage)
