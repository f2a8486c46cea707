"""The pytest plugin: a failing assert_close shows its report as `maskln verify` prints it; a
passing run shows nothing more (the runs are pytest's own, in this process, by pytester)."""

from __future__ import annotations

import importlib.metadata
import re

import pytest

pytest_plugins = ("pytester",)

KERNELS = """
import torch
from maskln_cli import testing


def one_pass(x, valid, scale, bias, eps):
    rows = torch.where(valid[..., None], x, 0)
    mean = rows.mean(-1, keepdim=True)
    var = (rows * rows).mean(-1, keepdim=True) - mean * mean
    out = (rows - mean) / torch.sqrt(var.clamp_min(0) + eps) * scale + bias
    return torch.where(valid[..., None], out, 0)


def inputs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 32, generator=generator) + 1000
    valid = torch.arange(8) < torch.tensor([[8], [5], [7], [2]])
    return x, valid, torch.ones(32), torch.zeros(32), 1e-5
"""
FAILING = """
from kernels import inputs, one_pass, testing


def test_one_pass():
    x, valid, scale, bias, eps = inputs()
    testing.assert_close(one_pass(x, valid, scale, bias, eps), x, valid, scale, bias, eps)
"""
PASSING = """
import torch
from kernels import inputs, testing
from maskln_cli import masked_layer_normalization


def test_maskln():
    x, valid, scale, bias, eps = inputs()
    out = masked_layer_normalization(x, valid, scale, bias, eps)
    testing.assert_close(out, x, valid, scale, bias, eps)


def test_a_plain_assert():
    assert [1, 2] == [1, 2]
"""
HYPOTHESIS = """
from hypothesis import given, settings
from kernels import one_pass, testing
from maskln_cli.testing.strategies import layer_norm_inputs


@settings(max_examples=150, derandomize=True, database=None, deadline=None)
@given(layer_norm_inputs())
def test_one_pass(inputs):
    testing.assert_close(one_pass(*inputs), *inputs)
"""
TIMING = re.compile(r" in [0-9.]+s( \([0-9:]+\))?")


@pytest.fixture(autouse=True, scope="module")
def _warm():
    """What the inner runs import, imported (and run) here first: pytester takes out of
    sys.modules what an inner run imported, and objects of torch's that outlive their
    modules crashed the garbage collector."""
    import hypothesis.strategies  # noqa: F401
    import torch

    from maskln_cli import testing
    from maskln_cli.testing import strategies  # noqa: F401

    x = torch.randn(2, 3, 4)
    report = testing.verify(x * 2, x, None, None, None)
    testing.report_text(report)


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makepyfile(kernels=KERNELS)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:randomly", *args)


def test_the_entry_point_is_declared():
    points = importlib.metadata.entry_points(group="pytest11")
    assert {p.name: p.value for p in points}.get("maskln") == "maskln_cli.testing.plugin"


def test_a_failure_shows_the_verdict_and_the_report(pytester):
    from maskln_cli import testing

    pytester.makepyfile(test_failing=FAILING)
    shown = run(pytester)
    shown.assert_outcomes(failed=1)
    text = shown.stdout.str()
    verdict = "FAIL: 1 of 1 tensors: out (all 22 valid rows off"
    assert re.search(rf"^E +AssertionError: {re.escape(verdict)}", text, re.M)
    # the report, unprefixed, in a section of its own: the same text as report_text's
    import sys

    sys.path.insert(0, str(pytester.path))
    try:
        kernels = importlib.import_module("kernels")
        x, valid, scale, bias, eps = kernels.inputs()
        report = testing.verify(kernels.one_pass(x, valid, scale, bias, eps), x, valid, scale,
                                bias, eps)  # fmt: skip
    finally:
        sys.path.remove(str(pytester.path))
        sys.modules.pop("kernels", None)
    section = text.split("maskln verify report", 1)[1].split("\n", 1)[1]
    assert section.split("\n=====", 1)[0].rstrip("\n") == testing.report_text(report)
    assert not re.search(r"^E .*(worst rows of out|budget)", text, re.M)
    assert "FAILED test_failing.py::test_one_pass - AssertionError: FAIL: 1 of 1" in text


def test_without_the_plugin_the_report_is_pytest_s_prefixed_message(pytester):
    pytester.makepyfile(test_failing=FAILING)
    text = run(pytester, "-p", "no:maskln").stdout.str()
    assert "maskln verify report" not in text
    assert re.search(r"^E +FAIL out ", text, re.M)  # each line of the message after 'E'


def test_a_hypothesis_failure_keeps_the_falsifying_example(pytester):
    pytester.makepyfile(test_property=HYPOTHESIS)
    shown = run(pytester)
    shown.assert_outcomes(failed=1)
    text = shown.stdout.str()
    assert re.search(r"^E +AssertionError: FAIL: 1 of 1 tensors: out \(", text, re.M)
    assert re.search(r"^E +inputs=LayerNormInputs\(x=tensor", text, re.M)
    assert "maskln verify report" in text


def test_a_passing_run_shows_nothing_more(pytester):
    pytester.makepyfile(test_passing=PASSING)
    outputs = []
    for args in ((), ("-p", "no:maskln")):
        shown = run(pytester, "-rA", *args)
        shown.assert_outcomes(passed=2)
        outputs.append(TIMING.sub("", shown.stdout.str()))
    # pytest's own header lists the plugins installed: maskln among them, the one difference
    with_plugin = outputs[0].replace(f"maskln-{importlib.metadata.version('maskln')}, ", "")
    assert with_plugin != outputs[0] and with_plugin == outputs[1]


@pytest.mark.slow
def test_a_failure_under_xdist_shows_the_report(pytester):
    pytester.makepyfile(test_failing=FAILING, test_passing=PASSING)
    pytester.makepyfile(kernels=KERNELS)
    shown = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")
    shown.assert_outcomes(failed=1, passed=2)
    text = shown.stdout.str()
    assert "maskln verify report" in text and "worst rows of out" in text
    assert re.search(r"^E +AssertionError: FAIL: 1 of 1 tensors: out \(", text, re.M)
