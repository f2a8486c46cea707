"""The report of ``maskln grade``: a line per clause, the diagnosis, the verdict line."""

from __future__ import annotations

from typing import TYPE_CHECKING

from maskln_cli.cli.report import consoles
from maskln_cli.cli.report.text import safe

if TYPE_CHECKING:
    from maskln_cli.grading.runner import GradeReport


def render_grade(report: GradeReport, quiet: bool = False) -> None:
    """The human report of ``maskln grade``: a line per clause (verdict, name, level, time),
    under a failing one its first counterexample or reason, then the diagnosis, then the
    verdict line. Everything the graded function said (exception messages) is escaped."""
    from maskln_cli.grading.runner import diagnosis_lines

    console = consoles.stdout_console()
    if not quiet:
        console.print(
            f"[bold]maskln grade[/] {safe(report.target)}  [dim](seed {report.seed},"
            f" device {safe(report.device)})[/]",
            soft_wrap=True,
        )
        console.print()
        width = max((len(c.name) for c in report.clauses), default=0)
        for clause in report.clauses:
            if clause.passed:
                verdict = "[bold green]PASS[/]"
            else:
                verdict = "[bold red]FAIL[/]" if clause.counted else "[bold yellow]FAIL[/]"
            level = "required" if clause.required else "strict"
            console.print(
                f"  {verdict}  {clause.name:<{width}}  [dim]{level:<8}[/]  {clause.seconds:6.2f} s",
                soft_wrap=True,
            )
            if clause.detail:
                console.print(f"        {safe(clause.detail)}", soft_wrap=True, style="dim")
        lines = diagnosis_lines(report)
        if lines:
            console.print()
            console.print("[bold]diagnosis[/]")
            for line in lines:
                console.print(f"  {safe(line)}", soft_wrap=True)
        console.print()
    console.print(grade_verdict_line(report), soft_wrap=True)


def grade_verdict_line(report: GradeReport) -> str:
    """The verdict line as rich markup: ``PASS`` green, ``FAIL`` red.

    Example:
        >>> from maskln_cli.grading import ClauseResult, GradeReport
        >>> grade_verdict_line(GradeReport("f", False, [ClauseResult("values", True, True, 0.1)]))
        '[bold green]PASS[/]: 1 of 1 required clauses pass'
    """
    word, _, rest = report.verdict().partition(":")
    color = "green" if report.passed else "red"
    return f"[bold {color}]{word}[/]:{safe(rest)}"
