"""The report in plain text, as ``maskln verify`` prints it off a terminal.

The words and tables are the command line's own (:func:`maskln_cli.cli.report.comparison.
render_comparison`), rendered on a console of our own: no colour, no wrapping, and the spaces
that pad table cells stripped from line ends, as verify's output piped to a file has them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from maskln_cli.compare.data import ComparisonReport


def report_text(report: ComparisonReport) -> str:
    """``report`` as ``maskln verify`` prints it to a pipe: header, a block per tensor, the
    worst rows of each failing one, notes, and the verdict line last."""
    import io

    from rich.console import Console

    from maskln_cli.cli.report.comparison import render_comparison
    from maskln_cli.cli.report.consoles import PIPED_WIDTH

    console = Console(
        file=io.StringIO(), width=PIPED_WIDTH, color_system=None, force_terminal=False,
        highlight=False, emoji=False, soft_wrap=False,
    )  # fmt: skip
    render_comparison(report, to=console)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    return "\n".join(line.rstrip() for line in text.rstrip("\n").split("\n"))


def verdict_line(report: ComparisonReport) -> str:
    """The report's verdict line (``PASS: ...`` or ``FAIL: ...``), as verify prints it last."""
    return report_text(report).rpartition("\n")[2]


def failure_message(report: ComparisonReport) -> str:
    """An assertion's message: the verdict line first (what pytest's one-line summary shows),
    then the report above it."""
    body, _, verdict = report_text(report).rpartition("\n")
    return f"{verdict}\n\n{body.rstrip()}"
