"""The report of ``maskln grade``: for one submission, the root cause, a line per clause, the
diagnosis and the verdict line; for a class, a table (a row per submission, a column per clause,
the root cause), JSON lines and the gradebook (:mod:`.gradebook`); progress on stderr."""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from maskln_cli.cli.report import consoles
from maskln_cli.cli.report.gradebook import (
    class_verdict_line,
    print_json_line,
    render_class,
    write_gradebook,
)
from maskln_cli.cli.report.text import plain_safe, safe

if TYPE_CHECKING:
    from rich.console import Console

    from maskln_cli.grading.report import GradeReport

__all__ = [
    "class_progress",
    "class_verdict_line",
    "clause_progress",
    "grade_verdict_line",
    "prepare_rendering",
    "print_json_line",
    "render_class",
    "render_grade",
    "write_gradebook",
]

PROGRESS_DELAY = 0.3
"""Seconds before progress appears (a grade that is over sooner shows none)."""


def render_grade(report: GradeReport, quiet: bool = False) -> None:
    """The human report of ``maskln grade``: the root cause first, a line per clause (verdict,
    name, level, time) with, under a failing one, its counterexample or reason (or the clause
    whose cause it shares), then the diagnosis of failures the root cause does not explain,
    then the verdict line. Lines wrap to a terminal's width; off a terminal nothing is wrapped.
    Everything the graded function said (exception messages) is escaped."""
    from maskln_cli.grading.report import clause_detail, diagnosis_lines

    console = consoles.stdout_console()
    if not quiet:
        rules = f", rules {safe(report.rules)}" if report.rules else ""
        if report.rules_source:
            rules += f" ({safe(report.rules_source)})"
        console.print(
            f"[bold]maskln grade[/] {safe(report.target)}  [dim](op {safe(report.op)}, seed"
            f" {report.seed},"
            f" device {safe(report.device)}{rules})[/]",
            soft_wrap=True,
        )
        console.print()
        lead = report.root_cause_lines()
        if lead:
            first, *rest = lead
            _indented(console, first, 0, "bold")
            for line in rest:
                _indented(console, line.strip(), 2, "")
            console.print()
        if report.problem:
            _indented(console, f"no verdict: {report.problem}", 0, "bold red")
            console.print()
        width = max((len(c.name) for c in report.clauses), default=0)
        for clause in report.clauses:
            if clause.passed:
                verdict = "[bold green]PASS[/]"
            else:
                verdict = "[bold red]FAIL[/]" if clause.counted else "[bold yellow]FAIL[/]"
            console.print(
                f"  {verdict}  {clause.name:<{width}}  [dim]{clause.level:<8}[/]"
                f"  {clause.seconds:6.2f} s",
                soft_wrap=True,
            )
            detail = clause_detail(clause)
            if detail:
                _indented(console, detail, 8, "dim italic" if clause.cause else "dim")
        lines = diagnosis_lines(report)
        if lines:
            console.print()
            console.print("[bold]diagnosis[/]")
            for line in lines:
                _indented(console, line, 2, "", hanging=2)
        console.print()
    console.print(grade_verdict_line(report), soft_wrap=True)


def _indented(console: Console, text: str, indent: int, style: str, hanging: int = 0) -> None:
    """``text`` (as it is: no markup) indented; on a terminal wrapped to its width, each
    continuation line ``hanging`` more columns in; off a terminal on one line."""
    from rich.padding import Padding
    from rich.text import Text

    shown = plain_safe(text)
    if not console.is_terminal:
        console.print(Text(" " * indent + shown, style=style), soft_wrap=True)
        return
    if hanging:
        lines = Text(shown, style=style).wrap(console, max(20, console.width - indent - hanging))
        for number, line in enumerate(lines):
            console.print(Padding(line, (0, 0, 0, indent + (hanging if number else 0))))
        return
    console.print(Padding(Text(shown, style=style), (0, 0, 0, indent)))


def grade_verdict_line(report: GradeReport) -> str:
    """The verdict line as rich markup: ``PASS`` green, ``FAIL`` red.

    Example:
        >>> from maskln_cli.grading.report import ClauseResult, GradeReport
        >>> grade_verdict_line(GradeReport("f", False, [ClauseResult("values", True, True, 0.1)]))
        '[bold green]PASS[/]: 1 of 1 required clauses pass'
    """
    word, _, rest = report.verdict().partition(":")
    color = "green" if report.passed else "red"
    return f"[bold {color}]{word}[/]:{safe(rest)}"


@contextlib.contextmanager
def clause_progress(target: str, enabled: bool = True) -> Iterator[Callable[[str, int, int], None]]:
    """A callback told ``(clause, index, total)`` as each clause starts; on a terminal (stderr)
    a line ``grading TARGET: values (3 of 20)`` shows it, gone when the grade ends."""
    with _status(enabled) as show:

        def update(name: str, index: int, total: int) -> None:
            show(f"grading {plain_safe(target)}: {name} ({index + 1} of {total})")

        yield update


@contextlib.contextmanager
def class_progress(total: int, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
    """A callback told ``(graded, total)``; on a terminal (stderr) ``graded 3 of 30``."""
    with _status(enabled) as show:
        show(f"graded 0 of {total} submissions")

        def update(graded: int, count: int) -> None:
            show(f"graded {graded} of {count} submissions")

        yield update


@contextlib.contextmanager
def _status(enabled: bool) -> Iterator[Callable[[str], None]]:
    """A transient status line on stderr, on a terminal only, once work has taken a moment."""
    console = consoles.stderr_console()
    started = time.monotonic()
    status = None
    latest = [""]

    def show(text: str) -> None:
        nonlocal status
        latest[0] = text
        if not enabled or not console.is_terminal:
            return
        if status is None:
            if time.monotonic() - started < PROGRESS_DELAY:
                return
            status = console.status(text, spinner="dots")
            status.start()
        status.update(text)

    try:
        yield show
    finally:
        if status is not None:
            status.stop()


def prepare_rendering() -> None:
    """Import everything the report, the table, the JSON lines, the gradebook and the progress
    use, by rendering samples into nothing, before any submission runs: a solution runs as the
    same user, and a file imported after it ran could have been changed by it (the grader
    refuses such an import, :mod:`maskln_cli.grading.guard`; better to need none)."""
    from rich.console import Console

    from maskln_cli.files import output  # noqa: F401 (the gradebook's writer)
    from maskln_cli.grading.classroom import ClassReport
    from maskln_cli.grading.report import ClauseResult, GradeReport, RootCause
    from maskln_cli.grading.selection import select

    consoles.stdout_console()
    consoles.stderr_console()
    failing = ClauseResult("values", True, False, 0.1, "a detail", [], level="required")
    sample = GradeReport(
        "sample.py",
        False,
        [failing, ClauseResult("dtypes", True, False, 0.1, "x", cause="values")],
        root_cause=RootCause("m", "description", "fix", "values", ["values", "dtypes"]),
    )
    for terminal in (True, False):
        console = Console(file=io.StringIO(), force_terminal=terminal, width=80)
        with _swapped_stdout(console):
            render_grade(sample)
            render_class(ClassReport(["sample.py", "other.py"], [sample]), select())
    with console.status("sample"):
        pass


@contextlib.contextmanager
def _swapped_stdout(console: Console) -> Iterator[None]:
    """Render into ``console`` instead of stdout (consoles are looked up at each call)."""
    original = consoles.stdout_console
    consoles.stdout_console = lambda: console  # type: ignore[assignment]
    try:
        yield
    finally:
        consoles.stdout_console = original  # type: ignore[assignment]
