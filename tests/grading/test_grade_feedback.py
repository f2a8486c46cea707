"""Speed and feedback of maskln grade (issue 22): usage errors refused before torch is imported;
the report wrapped to a terminal's width."""

from __future__ import annotations

import io

import pytest

from maskln_cli.cli.report import consoles
from maskln_cli.cli.report.grade import render_grade
from maskln_cli.grading.report import ClauseResult, GradeReport
from tests.clitools import run_without_torch_check


@pytest.mark.parametrize(
    "arguments",
    [["no/such/solution.py"], ["examples/first_attempt.py", "--only", "nope"],
     ["examples/first_attempt.py", "--with", "nope"], ["examples", "--shard", "0/2"]],
)  # fmt: skip
def test_usage_errors_are_refused_before_torch_is_imported(arguments):
    """A missing file or a bad option costs Python's start-up, not torch's import."""
    result = run_without_torch_check("grade", *arguments)
    assert result.exit_code == 2, result.stderr
    assert not result.torch_imported, result.stderr


def test_the_report_wraps_to_a_terminal_width(monkeypatch):
    """Long details wrap at the terminal's width, indented (not cut mid-word by the terminal)."""
    from rich.console import Console

    detail = "x [3, 6, 8] float64, eps 1e-05, contiguous: " + "a long counterexample " * 12
    report = GradeReport("f", False, [ClauseResult("values", True, False, 0.1, detail)])
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=80, color_system=None)
    monkeypatch.setattr(consoles, "stdout_console", lambda: console)
    render_grade(report)
    lines = out.getvalue().splitlines()
    assert max(map(len, lines)) <= 80, lines
    wrapped = [line for line in lines if line.startswith("        ") and "counterexample" in line]
    assert len(wrapped) >= 2, lines
