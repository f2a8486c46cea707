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
    wrapped at words; the clauses' numbers; then the class's verdict line, counts only. Every
    line fits the terminal (80 columns and up): the clauses' marks that do not fit a row are
    folded under it, as ``number mark``, unless they pass."""
    from maskln_cli.grading.classroom import clause_names

    names = clause_names(result.reports) or list(chosen.run)
    with plain_when_piped() as console:
        width = console.width if console.is_terminal else PIPED_WRAP
        if not quiet:
            count = len(result.targets)
            where = f" in {safe(folder)}" if folder else ""
            title = f"maskln grade: {count} submission{'s' if count != 1 else ''}{where}"
            fitted = _paths_wrapped if console.is_terminal else lambda text, _: [text]
            for i, line in enumerate(fitted(title, width)):
                console.print(f"[bold]{line}[/]" if i == 0 else line, soft_wrap=True)
            if rules:
                for line in fitted(f"rules: {safe(rules)}", width):
                    console.print(f"[dim]{line}[/]", soft_wrap=True)
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


def _paths_wrapped(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` columns, at spaces, and within a path longer than
    a line (as the terminal would break it, but indented)."""
    return textwrap.wrap(text, width=max(width, 40), subsequent_indent="  ",
                         break_long_words=True, break_on_hyphens=False) or [""]  # fmt: skip


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
    the clauses' numbers) and, under a failing one, why, indented and wrapped at words. The
    marks that do not fit ``width`` are folded under the row, those that are not a pass
    (``18 ✗, 21 ○``; a row not graded has none); a name too long for the line is broken over
    lines of its own."""
    shown = [relative_target(r.target, folder) for r in result.reports]
    missing = [relative_target(t, folder) for t in result.not_graded]
    numbers = [str(i) for i in range(1, len(names) + 1)]
    room = max(width, 40) - 2 - VERDICT_WIDTH  # what the name and the marks share
    first = max([len("submission"), *map(len, shown + missing)])
    first = max(len("submission"), min(first, room - 3 * min(len(numbers), FEWEST_MARKS)))
    fit = 0
    used = first + 2 + VERDICT_WIDTH
    while fit < len(numbers) and used + 2 + len(numbers[fit]) <= max(width, 40):
        used += 2 + len(numbers[fit])
        fit += 1
    header = f"{'submission'.ljust(first)}  {'verdict'.ljust(VERDICT_WIDTH)}"
    lines = [f"[bold]{safe(header + '  '.join(['', *numbers[:fit]]))}[/]"]
    if fit < len(numbers):
        lines.append(f"[dim]{safe(' ' * FOLD + _folded_words(numbers, fit))}[/]")

    def row(name: str, verdict: str, visible: int, marks: list[str], graded: bool) -> list[str]:
        cells = [
            " " * (len(number) - 1) + mark
            for mark, number in zip(marks[:fit], numbers[:fit], strict=True)
        ]
        parts = _broken(name, first)
        head = f"{safe(parts[0].ljust(first))}  {verdict}{' ' * (VERDICT_WIDTH - visible)}"
        out = [head + "  ".join(["", *cells])] + [safe(part) for part in parts[1:]]
        folded = [
            (f"{number} {_GLYPHS[mark]}", f"{number} {mark}")
            for number, mark in zip(numbers[fit:], marks[fit:], strict=True)
            if mark != MARKS["pass"] and graded
        ]
        out += [" " * FOLD + line for line in _wrapped_marks(folded, max(width, 40) - FOLD)]
        return out

    for report, name in zip(result.reports, shown, strict=True):
        clauses = {c.name: c for c in report.clauses}
        verdict = "[bold green]PASS[/]" if report.passed else "[bold red]FAIL[/]"
        lines += row(name, verdict, 4, [_mark(clauses.get(clause)) for clause in names], True)
        why = _why(report)
        if why:
            lines += [f"[dim]{safe(line)}[/]" for line in _wrapped(why, width, indent="    ")]
    for name in missing:
        lines += row(name, "[dim]not graded[/]", 10, [MARKS["none"]] * len(names), False)
    return lines


VERDICT_WIDTH = 10
"""The verdict's column: ``PASS``, ``FAIL``, ``not graded``."""
FEWEST_MARKS = 8
"""The marks a row keeps on its line however long the names (a longer name is broken)."""
FOLD = 4
"""Indentation of what is folded under a row."""
_GLYPHS = {markup: markup.split("]")[1].split("[")[0] for markup in MARKS.values()}
"""Each mark's character, as seen (the markup's width is not the terminal's)."""


def _folded_words(numbers: list[str], fit: int) -> str:
    first, last = numbers[fit], numbers[-1]
    which = f"clause {first}" if first == last else f"clauses {first} to {last}"
    return f"{which}: ✓ unless under the row"


def _broken(name: str, width: int) -> list[str]:
    """``name`` in pieces of ``width`` characters at most (paths have no spaces to wrap at)."""
    return [name[i : i + width] for i in range(0, len(name), width)] or [""]


def _wrapped_marks(items: list[tuple[str, str]], width: int) -> list[str]:
    """Folded marks, ``(plain, markup)`` each, as markup lines of at most ``width`` columns
    (measured on the plain text), never breaking an item."""
    lines: list[tuple[int, str]] = []
    for plain, markup in items:
        if lines and lines[-1][0] + 2 + len(plain) <= width:
            lines[-1] = (lines[-1][0] + 2 + len(plain), f"{lines[-1][1]}, {markup}")
        else:
            if lines:
                lines[-1] = (lines[-1][0] + 1, lines[-1][1] + ",")
            lines.append((len(plain), markup))
    return [markup for _, markup in lines]


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
    result: ClassReport,
    folder: str | None = None,
    rules: str | None = None,
    rules_source: str | None = None,
    op: str | None = None,
) -> list[list[str]]:
    """The gradebook: a header, then a row per submission (not graded ones too), its path
    relative to ``folder``, the rule set that graded it and the exercise (``op``: ``layer``
    or ``rms``; a report's own, else ``op``)."""
    from maskln_cli.grading.classroom import clause_names

    names = clause_names(result.reports)
    header = ["submission", "verdict", "passed", "counted", "failed", "root_cause", "why", "rules",
              "rules_source", "op"]  # fmt: skip
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
            report.rules_source or rules_source or "",
            report.op,
        ]
        for name in names:
            clause = clauses.get(name)
            cells.append("" if clause is None else _verdict_word(clause))
        rows.append([plain_safe(cell) for cell in cells])
    for target in result.not_graded:
        shown = relative_target(target, folder)
        cells = [shown, "NOT GRADED"] + [""] * (len(header) - 5)
        cells += [rules or "", rules_source or "", op or ""]
        rows.append([plain_safe(cell) for cell in cells + [""] * len(names)])
    return rows


def _verdict_word(clause: ClauseResult) -> str:
    """``pass``; ``fail``; ``fail (not counted)`` for a failure that does not count."""
    if clause.passed:
        return "pass"
    return "fail" if clause.counted else "fail (not counted)"


def write_gradebook(
    path: str,
    result: ClassReport,
    folder: str | None = None,
    rules: str | None = None,
    rules_source: str | None = None,
    op: str | None = None,
) -> None:
    """The gradebook as CSV, written atomically (a new file replaces ``path`` only when
    complete); a note on stderr says where, and under which rules."""
    from maskln_cli.cli.report.messages import note
    from maskln_cli.files.output import open_output

    text = io.StringIO(newline="")
    csv.writer(text).writerows(gradebook_rows(result, folder, rules, rules_source, op))
    data = text.getvalue().encode()
    with open_output(path, len(data)) as stream:
        stream.write(data)
    graded = f"{len(result.reports)} of {len(result.targets)} submissions"
    note(f"wrote {path}: {graded}" + (f", rules {rules}" if rules else ""))
