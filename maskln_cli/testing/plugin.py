"""The pytest plugin: a failing ``assert_close`` shown as ``maskln verify`` prints its report.

pytest loads it in every run where maskln is installed (the ``pytest11`` entry point
``maskln``; ``-p no:maskln`` leaves it out). It changes only the failures an
:func:`~maskln_cli.testing.assert_close` raised: the traceback keeps the test's line and the
report's verdict (``E   AssertionError: FAIL: 1 of 4 tensors: grad_scale (...)``, also the
one-line summary's), instead of the whole report prefixed line by line with ``E``, and the
report follows in a section of its own, the budget table and the worst rows as ``maskln
verify`` prints them. A passing run shows nothing more; the plugin adds no option, header
or summary. Loading it imports neither torch nor hypothesis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from _pytest.reports import TestReport

    from maskln_cli.testing.judging import VerifyFailed

SECTION = "maskln verify report"
"""The title of the section holding the report."""
FAILURE_MARKER = "E   "


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> TestReport:
    report: TestReport = yield
    excinfo = call.excinfo
    if report.failed and excinfo is not None:
        from maskln_cli.testing.judging import VerifyFailed

        if isinstance(excinfo.value, VerifyFailed):
            _show_report(report, excinfo.value)
    return report


def _show_report(report: TestReport, failure: VerifyFailed) -> None:
    """The verdict in the traceback, the report in a section (a traceback style without
    pytest's own entries, such as ``--tb=native``, is left as it is)."""
    from maskln_cli.testing.text import report_text

    verdict = str(failure).split("\n", 1)[0]
    longrepr = report.longrepr
    traceback = getattr(longrepr, "reprtraceback", None)
    entries = getattr(traceback, "reprentries", None)
    if not entries or not hasattr(entries[-1], "lines"):
        return
    last = entries[-1]
    lines = list(last.lines)
    first = next((i for i, line in enumerate(lines) if line.startswith(FAILURE_MARKER)), None)
    if first is None:
        return
    # The message's lines give way to its verdict; what follows them stays (the notes of
    # the exception: Hypothesis's falsifying example).
    shown = len(str(failure).split("\n"))
    indent = lines[first][: len(lines[first]) - len(lines[first][1:].lstrip())]
    last.lines = [*lines[:first], f"{indent}AssertionError: {verdict}", *lines[first + shown :]]
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        crash.message = f"AssertionError: {verdict}"
    report.sections.append((SECTION, report_text(failure.report)))
