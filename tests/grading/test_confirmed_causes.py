"""Issue 38 (maskln grade, round four), item 4, in process: a cause is named only when a test
confirms it (the counterexample re-run with the suspected cause's condition varied). Each wrong
leading cause the issue lists is replaced by its own cause, confirmed, and the refuted one is
named nowhere; without a confirmed cause, the counterexample and where it differs, in words.
The solutions are tests/solutions/round_four.py."""

from __future__ import annotations

import pytest
import torch

from maskln_cli.grading.runner import grade
from tests.solutions import round_four

CONFIRMED = {
    "float32_reciprocal_in_backward": ("gradients_in_float32", {"channel_remainder_lost"}),
    "one_channel_returns_zeros": ("wrong_at_one_channel", {"stale_mask"}),
    "clamped_variance": ("variance_clamped", {"eps_squared"}),
    "statistics_cached_by_id": (
        "result_from_earlier_call",
        {"float64_not_cast_back", "broadcasting_error", "wrong_at_one_channel"},
    ),
    "nanmean_padding": ("nan_made_in_padding", {"eps_missing", "nan_without_padding"}),
    "variance_around_detached_mean": ("mean_detached_in_variance", {"backward_from_saved_values"}),
    "channels_from_size_one": ("channels_from_another_axis", {"statistics_over_valid_rows"}),
    "backward_sums_padding_into_grad_bias": ("padding_in_grad_bias", set()),
    "backward_leaves_grad_x_in_padding": ("grad_x_in_padding", set()),
}
"""Each solution: the cause that must lead its report, and the causes named before that its
tests refute (named nowhere in the report)."""
HANDOUT = ["second_order", "positive_zero"]


@pytest.mark.parametrize("name", CONFIRMED)
def test_each_cause_leads_its_report_and_no_refuted_one_is_named(name):
    cause, refuted = CONFIRMED[name]
    report = grade(getattr(round_four, name), include=HANDOUT)
    assert not report.passed
    assert report.root_cause is not None, report.text()
    assert report.root_cause.mistake == cause, report.text()
    named = {d["mistake"] for d in report.diagnosis if d["mistake"]}
    assert not named & refuted, report.text()


def test_without_a_confirmed_cause_the_report_says_where_it_differs():
    report = grade(round_four.sqrt_eps_added_to_std, only=["values", "gradients"])
    assert report.root_cause is None, report.text()
    assert report.differs is not None
    assert "out" in report.differs and "valid rows" in report.differs, report.differs
    assert "where it differs" in report.text()


def test_an_output_cut_from_the_graph_is_not_a_result_from_an_earlier_call():
    """The class of round four: C = 1 returning bias detached was called 'a result from an
    earlier call' (the counterexample given again had the right values; its output did not
    require grad, as before). A re-run is right only when its output requires grad too."""
    report = grade(round_four.one_channel_bias_detached, include=HANDOUT)
    assert not report.passed
    named = {d["mistake"] for d in report.diagnosis if d["mistake"]}
    assert "result_from_earlier_call" not in named, report.text()
    assert report.root_cause is None or report.root_cause.mistake != "result_from_earlier_call"


class _BackwardAddingMeanTerm(torch.autograd.Function):
    """A hand-written backward from saved values, adding grad_x's mean term, not subtracting."""

    @staticmethod
    def forward(ctx, x, scale, bias, eps):
        mean = x.mean(-1, keepdim=True)
        rstd = torch.rsqrt((x - mean).square().mean(-1, keepdim=True) + eps)
        xhat = (x - mean) * rstd
        ctx.save_for_backward(xhat, rstd, scale)
        return xhat * scale + bias

    @staticmethod
    def backward(ctx, grad_out):
        xhat, rstd, scale = ctx.saved_tensors
        wdy = grad_out * scale
        c1, c2 = (wdy * xhat).mean(-1, keepdim=True), wdy.mean(-1, keepdim=True)
        grad_x = rstd * (wdy + c2 - xhat * c1)
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        return grad_x, (rows * xhat.reshape(rows.shape)).sum(0), rows.sum(0), None


def _backward_adding_mean_term(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    x = torch.where(keep, x, 0.0)
    return torch.where(keep, _BackwardAddingMeanTerm.apply(x, scale, bias, eps), 0.0)


def test_a_cause_of_strict_clauses_alone_is_not_the_root_cause_of_counted_ones():
    """A custom backward whose first derivative is wrong fails the counted gradient clauses and
    the strict second_order, not counted (its second derivative, from saved values, is wrong
    too). The second-order cause explains none of the counted failures: it was shown as 'root
    cause: one mistake explains 0 of the 4 failing clauses' (the class of round four's oskar)."""
    report = grade(_backward_adding_mean_term)
    assert not report.passed
    failing = {c.name for c in report.clauses if c.counted and not c.passed}
    assert "gradients" in failing, report.text()
    if report.root_cause is not None:
        assert failing & set(report.root_cause.explains), report.text()
    assert "explains 0 of" not in report.text()
