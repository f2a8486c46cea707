"""A class's grade as people read it: a table (a row per submission, a column per clause, the root
cause), JSON lines (one object per submission, as each is graded) and a CSV gradebook."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
import textwrap
from typing import TYPE_CHECKING, Any

from maskln_cli.cli.report.consoles import closed_pipe_ends_quietly, plain_when_piped
from maskln_cli.cli.report.text import plain_safe, safe

if TYPE_CHECKING:
    from maskln_cli.grading.classroom import ClassReport
    from maskln_cli.grading.report import ClauseResult, GradeReport
    from maskln_cli.grading.selection import Selection

MARKS = {
    "pass": "[green]✓[/]",
    "fail": "[bold red]✗[/]",
    "uncounted": "[yellow]○[/]",
    "cause": "[red]=[/]",
    "none": "[dim]·[/]",
}
"""A mark per clause, told apart without colour: a counted failure ✗ (or = when it fails
through the row's root cause), a failure not counted ○."""
LEGEND = (
    "✓ passes, ✗ fails, = fails through the root cause, ○ fails but is not counted,"
    " · not graded; maskln grade SUBMISSION for its report"
)
PIPED_WRAP = 100
"""Off a terminal, the lines under a row (its root cause or first failure) and the legend are
wrapped at words to this width: a file or a pager then never cuts a word."""


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


def render_class(
    result: ClassReport,
    chosen: Selection,
    quiet: bool = False,
    folder: str | None = None,
    rules: str | None = None,
) -> None:
    """The table of a class: a row per submission (its path relative to ``folder``, its
    verdict, a mark per clause), under a failing row its root cause or first failure in full,
    wrapped at words; the clauses' numbers; then the class's verdict line, counts only."""
    from maskln_cli.grading.classroom import clause_names

    names = clause_names(result.reports) or list(chosen.run)
    with plain_when_piped() as console:
        width = console.width if console.is_terminal else PIPED_WRAP
        if not quiet:
            count = len(result.targets)
            where = f" in {safe(folder)}" if folder else ""
            console.print(
                f"[bold]maskln grade[/]: {count} submission{'s' if count != 1 else ''}{where}",
                soft_wrap=True,
            )
            if rules:
                console.print(f"[dim]rules: {safe(rules)}[/]", soft_wrap=True)
            console.print()
            for line in _rows(result, names, folder, width):
                console.print(line, soft_wrap=True)
            console.print()
            items = [f"{i} {name}" for i, name in enumerate(names, 1)]
            for line in _wrapped_items(items, width) + _wrapped(LEGEND, width):
                console.print(f"[dim]{safe(line)}[/]", soft_wrap=True)
            console.print()
        console.print(class_verdict_line(result), soft_wrap=True)


def _wrapped(text: str, width: int, indent: str = "") -> list[str]:
    """``text`` in lines of at most ``width`` columns, broken at spaces only (a word longer
    than the line stays whole)."""
    return textwrap.wrap(
        text,
        width=max(width, 40),
        initial_indent=indent,
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [indent]


def _wrapped_items(items: list[str], width: int) -> list[str]:
    """``items`` joined by ``, `` in lines of at most ``width`` columns, never breaking an
    item (``7 sanitized_padding`` stays together)."""
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + 2 + len(item) <= max(width, 40):
            lines[-1] += f", {item}"
        else:
            if lines:
                lines[-1] += ","
            lines.append(item)
    return lines


def relative_target(target: str, folder: str | None) -> str:
    """A submission as a class report shows it: relative to the folder graded when it is a
    file in it (``alice.py``, ``alice.py:NAME``), else as given.

    Example:
        >>> relative_target("pkg.mod:fn", "/course/submissions")
        'pkg.mod:fn'
    """
    if not folder:
        return target
    location, suffix = target, ""
    if not os.path.exists(target):
        location, colon, name = target.rpartition(":")
        if not colon or not os.path.exists(location):
            return target  # a module target
        suffix = f":{name}"
    relative = os.path.relpath(os.path.abspath(location), folder)
    return target if relative.startswith(os.pardir) else relative + suffix


def _rows(result: ClassReport, names: list[str], folder: str | None, width: int) -> list[str]:
    """The table's lines, as markup: a header, then a line per submission (its marks under
    the clauses' numbers) and, under a failing one, why, indented and wrapped at words."""
    shown = [relative_target(r.target, folder) for r in result.reports]
    missing = [relative_target(t, folder) for t in result.not_graded]
    first = max([len("submission"), *map(len, shown + missing)])
    numbers = [str(i) for i in range(1, len(names) + 1)]
    lines = [f"[bold]{safe('submission'.ljust(first))}  verdict     {'  '.join(numbers)}[/]"]

    def row(name: str, verdict: str, visible: int, marks: list[str]) -> str:
        cells = [
            " " * (len(number) - 1) + mark for mark, number in zip(marks, numbers, strict=True)
        ]
        return f"{safe(name.ljust(first))}  {verdict}{' ' * (10 - visible)}  {'  '.join(cells)}"

    for report, name in zip(result.reports, shown, strict=True):
        clauses = {c.name: c for c in report.clauses}
        verdict = "[bold green]PASS[/]" if report.passed else "[bold red]FAIL[/]"
        lines.append(row(name, verdict, 4, [_mark(clauses.get(clause)) for clause in names]))
        why = _why(report)
        if why:
            lines += [f"[dim]{safe(line)}[/]" for line in _wrapped(why, width, indent="    ")]
    for name in missing:
        lines.append(row(name, "[dim]not graded[/]", 10, [MARKS["none"]] * len(names)))
    return lines


def _mark(clause: ClauseResult | None) -> str:
    if clause is None:
        return MARKS["none"]
    if clause.passed:
        return MARKS["pass"]
    if not clause.counted:
        return MARKS["uncounted"]
    return MARKS["cause"] if clause.cause is not None else MARKS["fail"]


def _why(report: GradeReport) -> str:
    """The root cause, else why there is no verdict, else the first failing counted clause's
    detail: whole (a cell or a line wraps it at words)."""
    if report.problem:
        return report.problem
    if report.root_cause is not None:
        return report.root_cause.description
    failing = [c for c in report.clauses if c.counted and not c.passed]
    if failing:
        return f"{failing[0].name}: {failing[0].detail or ''}"
    return ""


def class_verdict_line(result: ClassReport) -> str:
    """``PASS: 30 of 30 submissions pass`` or ``FAIL: 27 of 30 submissions pass, 3 fail``, and
    what was not graded (Ctrl-C, or the grader's files changed), as markup: counts, not
    paths (the table and the gradebook name them)."""
    failed = [r.target for r in result.reports if not r.passed]
    total = len(result.targets)
    passing = len(result.reports) - len(failed)
    word = "[bold green]PASS[/]" if result.passed else "[bold red]FAIL[/]"
    if result.interrupted:
        word = "[bold yellow]INTERRUPTED[/]"
    line = f"{word}: {passing} of {total} submission{'s' if total != 1 else ''} pass"
    if failed:
        line += f", {len(failed)} fail"
    missing = result.not_graded
    if missing:
        why = "interrupted" if result.interrupted else "stopped"
        line += f"; {why} before {len(missing)} were graded"
    if result.problem:
        line += f"; {safe(result.problem)}"
    return line


def gradebook_rows(
    result: ClassReport, folder: str | None = None, rules: str | None = None
) -> list[list[str]]:
    """The gradebook: a header, then a row per submission (not graded ones too), its path
    relative to ``folder``, the rule set that graded it."""
    from maskln_cli.grading.classroom import clause_names

    names = clause_names(result.reports)
    header = ["submission", "verdict", "passed", "counted", "failed", "root_cause", "why", "rules",
              "rules_source"]  # fmt: skip
    rows = [header + names]
    for report in result.reports:
        clauses = {c.name: c for c in report.clauses}
        counted = [c for c in report.clauses if c.counted]
        cells = [
            relative_target(report.target, folder),
            "PASS" if report.passed else "FAIL",
            str(sum(c.passed for c in counted)),
            str(len(counted)),
            " ".join(report.failed),
            report.root_cause.mistake if report.root_cause else "",
            _why(report),
            report.rules or rules or "",
            report.rules_source or "",
        ]
        for name in names:
            clause = clauses.get(name)
            cells.append("" if clause is None else _verdict_word(clause))
        rows.append([plain_safe(cell) for cell in cells])
    for target in result.not_graded:
        shown = relative_target(target, folder)
        cells = [shown, "NOT GRADED"] + [""] * (len(header) - 4) + [rules or "", ""]
        rows.append([plain_safe(cell) for cell in cells + [""] * len(names)])
    return rows


def _verdict_word(clause: ClauseResult) -> str:
    """``pass``; ``fail``; ``fail (not counted)`` for a failure that does not count."""
    if clause.passed:
        return "pass"
    return "fail" if clause.counted else "fail (not counted)"


def write_gradebook(
    path: str, result: ClassReport, folder: str | None = None, rules: str | None = None
) -> None:
    """The gradebook as CSV, written atomically (a new file replaces ``path`` only when
    complete); a note on stderr says where, and under which rules."""
    from maskln_cli.cli.report.messages import note
    from maskln_cli.files.output import open_output

    text = io.StringIO(newline="")
    csv.writer(text).writerows(gradebook_rows(result, folder, rules))
    data = text.getvalue().encode()
    with open_output(path, len(data)) as stream:
        stream.write(data)
    graded = f"{len(result.reports)} of {len(result.targets)} submissions"
    note(f"wrote {path}: {graded}" + (f", rules {rules}" if rules else ""))
