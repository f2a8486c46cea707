"""Calls checked against each other (issue 32, item 2): the same inputs give the same bits (on
another thread count too), a later call leaves an earlier result alone, torch's global state
is the same after a call, and nothing is left on the caller's tensors. Each wrong solution of
tests/solutions/cross_calls.py (three ways each) passed every mode before; each global setting
a call could leave changed is caught; grading in process leaves the caller's state alone."""

from __future__ import annotations

import pytest
import torch

from maskln_cli.grading.clauses import CLAUSES
from maskln_cli.grading.clauses.state import global_state, state_changes
from maskln_cli.grading.runner import grade
from tests.solutions import cross_calls
from tests.solutions.correct import masked_layer_normalization as correct

CROSS_CALLS = ["deterministic", "no_shared_results", "no_global_effects", "no_hooks_left"]

FALSE_PASSES = {
    "threads_sum_in_completion_order": ("deterministic", "not_deterministic"),
    "one_chunk_per_thread": ("deterministic", "not_deterministic"),
    "autotuned_block": ("deterministic", "not_deterministic"),
    "reuses_output_buffer": ("no_shared_results", "shared_result"),
    "cached_workspace_output": ("no_shared_results", "shared_result"),
    "kernel_object_output": ("no_shared_results", "shared_result"),
    "sets_default_dtype": ("no_global_effects", "global_state_changed"),
    "restores_default_dtype_to_float32": ("no_global_effects", "global_state_changed"),
    "default_dtype_follows_x": ("no_global_effects", "global_state_changed"),
    "hook_zeroes_padding_gradient": ("no_hooks_left", "hooks_left"),
    "hook_cleans_scale_gradient": ("no_hooks_left", "hooks_left"),
    "caches_mask_on_the_tensor": ("no_hooks_left", "hooks_left"),
}


@pytest.fixture(autouse=True)
def _state_is_left_alone():
    """Every test here grades functions that change torch's global state: grading puts it
    back (the test fails otherwise, and restores it for the others)."""
    before = global_state()
    yield
    after = global_state()
    torch.set_default_dtype(before["default dtype"])
    assert state_changes(before, after, random_state=True) == []


@pytest.mark.parametrize("name", FALSE_PASSES)
def test_each_former_false_pass_fails_its_cross_call_clause(name):
    clause, cause = FALSE_PASSES[name]
    report = grade(getattr(cross_calls, name), only=CROSS_CALLS)
    assert {c.name for c in report.clauses if not c.passed} == {clause}, report.text()
    assert report.root_cause is not None and report.root_cause.mistake == cause, report.text()


def test_a_later_call_overwriting_a_result_says_so():
    report = grade(cross_calls.reuses_output_buffer, only=["no_shared_results"])
    detail = report.clauses[0].detail
    assert "under torch.no_grad(): a later call changed this call's result: at" in detail


def test_the_same_bits_on_another_thread_count():
    report = grade(cross_calls.one_chunk_per_thread, only=["deterministic"])
    detail = report.clauses[0].detail
    assert "the same inputs gave other bits in call 4 (3 threads)" in detail, detail
    assert "call 1 (1 thread) gave" in detail


def _leaves(change):
    def solution(x, valid, scale, bias, eps=1e-05):
        change()
        return correct(x, valid, scale, bias, eps)

    return solution


GLOBAL_SETTINGS = {
    "default dtype": lambda: torch.set_default_dtype(torch.float64),
    "deterministic algorithms": lambda: torch.use_deterministic_algorithms(True),
    "grad mode": lambda: torch.set_grad_enabled(False),
    "threads": lambda: torch.set_num_threads(torch.get_num_threads() + 1),
    "anomaly mode": lambda: torch.autograd.set_detect_anomaly(True),
    "autocast (cpu)": lambda: torch.set_autocast_enabled("cpu", True),
    "print options": lambda: torch.set_printoptions(precision=10),
    "float32 matmul precision": lambda: torch.set_float32_matmul_precision("medium"),
    "flush denormal": lambda: torch.set_flush_denormal(True),
}


@pytest.mark.parametrize("setting", GLOBAL_SETTINGS)
def test_each_global_setting_left_changed_is_named(setting):
    report = grade(_leaves(GLOBAL_SETTINGS[setting]), only=["no_global_effects"])
    (clause,) = report.clauses
    assert not clause.passed
    assert f"torch's global state changed: {setting} " in clause.detail, clause.detail
    assert report.root_cause.mistake == "global_state_changed"


def test_a_result_that_is_a_view_of_an_input_is_shared():
    def expands_bias(x, valid, scale, bias, eps=1e-05):
        if x.shape[-1] == 1 and bool(valid.all()):  # every row is bias: "no copy needed"
            return bias.expand(x.shape)
        return correct(x, valid, scale, bias, eps)

    report = grade(expands_bias, only=["no_shared_results"])
    detail = report.clauses[0].detail
    assert "the result shares its storage with the input bias" in detail, detail


def test_a_backward_inside_the_call_leaves_grad_on_the_inputs():
    def checks_its_own_gradient(x, valid, scale, bias, eps=1e-05):
        out = correct(x, valid, scale, bias, eps)
        if out.requires_grad:
            out.sum().backward(retain_graph=True)  # "sanity check", filling x.grad
        return out

    report = grade(checks_its_own_gradient, only=["no_hooks_left"])
    detail = report.clauses[0].detail
    assert "x .grad (False -> True)" in detail, detail


def test_deterministic_cases_stay_under_torch_parallel_grain():
    """torch reduces a tensor of fewer than 32,768 elements on one thread, whatever the thread
    count: a correct function gives the same bits on 1 and 3 threads."""
    for case in CLAUSES["deterministic"].build(0):
        assert case.x.numel() < 32_768, case.label


def test_correct_functions_pass_the_cross_call_clauses():
    from maskln_cli import masked_layer_normalization
    from tests.solutions import variants

    for fn in (correct, masked_layer_normalization, variants.welford, variants.matmul_means):
        report = grade(fn, only=CROSS_CALLS)
        assert report.passed, report.text()
