"""A class's grade as people read it: a table (a row per submission, a column per clause, the root
cause), JSON lines (one object per submission, as each is graded) and a CSV gradebook."""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from typing import TYPE_CHECKING, Any

from maskln_cli.cli.report.consoles import closed_pipe_ends_quietly, plain_when_piped
from maskln_cli.cli.report.text import plain_safe, safe

if TYPE_CHECKING:
    from rich.table import Table

    from maskln_cli.grading.classroom import ClassReport
    from maskln_cli.grading.report import ClauseResult, GradeReport
    from maskln_cli.grading.selection import Selection

MARKS = {
    "pass": "[green]✓[/]",
    "fail": "[bold red]✗[/]",
    "uncounted": "[yellow]✗[/]",
    "cause": "[red]=[/]",
    "none": "[dim]·[/]",
}
LEGEND = "✓ passes, ✗ fails (yellow: not counted), = fails through the root cause, · not graded"


def print_json_line(data: dict[str, Any]) -> None:
    """One JSON object on one line of stdout (NaN and inf as null), flushed: a class's report
    as JSON lines, one per submission, written as each is graded."""
    with closed_pipe_ends_quietly():
        sys.stdout.write(json.dumps(_finite(data), ensure_ascii=True) + "\n")
        sys.stdout.flush()


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def render_class(result: ClassReport, chosen: Selection, quiet: bool = False) -> None:
    """The table of a class: a row per submission (its verdict, a mark per clause, the root
    cause or the reason it failed), the clauses' numbers, then the class's verdict line."""
    from maskln_cli.grading.classroom import clause_names

    names = clause_names(result.reports) or list(chosen.run)
    with plain_when_piped() as console:
        if not quiet:
            count = len(result.targets)
            console.print(
                f"[bold]maskln grade[/]: {count} submission{'s' if count != 1 else ''}",
                soft_wrap=True,
            )
            console.print()
            console.print(_table(result, names))
            console.print()
            legend = ", ".join(f"{i} {name}" for i, name in enumerate(names, 1))
            console.print(f"[dim]{legend}[/]")
            console.print(f"[dim]{LEGEND}; maskln grade SUBMISSION for its report[/]")
            console.print()
        console.print(class_verdict_line(result), soft_wrap=True)


def _table(result: ClassReport, names: list[str]) -> Table:
    from rich.table import Table

    table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False)
    table.add_column("submission", no_wrap=True, style="bold")
    table.add_column("verdict", no_wrap=True)
    for number in range(1, len(names) + 1):
        table.add_column(str(number), justify="center", no_wrap=True)
    table.add_column("root cause", overflow="fold", ratio=1, min_width=20)
    for report in result.reports:
        clauses = {c.name: c for c in report.clauses}
        verdict = "[bold green]PASS[/]" if report.passed else "[bold red]FAIL[/]"
        marks = [_mark(clauses.get(name)) for name in names]
        table.add_row(safe(report.target), verdict, *marks, safe(_why(report)))
    for target in result.not_graded:
        table.add_row(safe(target), "[dim]not graded[/]", *([MARKS["none"]] * len(names)), "")
    return table


def _mark(clause: ClauseResult | None) -> str:
    if clause is None:
        return MARKS["none"]
    if clause.passed:
        return MARKS["pass"]
    if clause.cause is not None:
        return MARKS["cause"]
    return MARKS["fail"] if clause.counted else MARKS["uncounted"]


def _why(report: GradeReport) -> str:
    """The root cause in a few words, else why there is no verdict, else the first failing
    counted clause's detail."""
    if report.problem:
        return report.problem
    if report.root_cause is not None:
        return report.root_cause.description
    failing = [c for c in report.clauses if c.counted and not c.passed]
    if failing:
        detail = failing[0].detail or ""
        return f"{failing[0].name}: {detail[:160]}{'...' if len(detail) > 160 else ''}"
    return ""


def class_verdict_line(result: ClassReport) -> str:
    """``PASS: 30 of 30 submissions pass`` or ``FAIL: 27 of 30 submissions pass; failed:
    ...``, and what was not graded (Ctrl-C, or the grader's files changed), as markup."""
    failed = [r.target for r in result.reports if not r.passed]
    total = len(result.targets)
    passing = len(result.reports) - len(failed)
    word = "[bold green]PASS[/]" if result.passed else "[bold red]FAIL[/]"
    if result.interrupted:
        word = "[bold yellow]INTERRUPTED[/]"
    line = f"{word}: {passing} of {total} submission{'s' if total != 1 else ''} pass"
    if failed:
        line += f"; failed: {safe(', '.join(failed))}"
    missing = result.not_graded
    if missing:
        why = "interrupted" if result.interrupted else "stopped"
        line += f"; {why} before {len(missing)} were graded"
    if result.problem:
        line += f"; {safe(result.problem)}"
    return line


def gradebook_rows(result: ClassReport) -> list[list[str]]:
    """The gradebook: a header, then a row per submission (not graded ones too)."""
    from maskln_cli.grading.classroom import clause_names

    names = clause_names(result.reports)
    header = ["submission", "verdict", "passed", "counted", "failed", "root_cause", "why"]
    rows = [header + names]
    for report in result.reports:
        clauses = {c.name: c for c in report.clauses}
        counted = [c for c in report.clauses if c.counted]
        cells = [
            report.target,
            "PASS" if report.passed else "FAIL",
            str(sum(c.passed for c in counted)),
            str(len(counted)),
            " ".join(report.failed),
            report.root_cause.mistake if report.root_cause else "",
            _why(report),
        ]
        for name in names:
            clause = clauses.get(name)
            cells.append("" if clause is None else ("pass" if clause.passed else "fail"))
        rows.append([plain_safe(cell) for cell in cells])
    for target in result.not_graded:
        rows.append([plain_safe(target), "NOT GRADED"] + [""] * (len(header) - 2 + len(names)))
    return rows


def write_gradebook(path: str, result: ClassReport) -> None:
    """The gradebook as CSV, written atomically (a new file replaces ``path`` only when
    complete); a note on stderr says where."""
    from maskln_cli.cli.report.messages import note
    from maskln_cli.files.output import open_output

    text = io.StringIO(newline="")
    csv.writer(text).writerows(gradebook_rows(result))
    data = text.getvalue().encode()
    with open_output(path, len(data)) as stream:
        stream.write(data)
    note(f"wrote {path}: {len(result.reports)} of {len(result.targets)} submissions")
