"""The report of ``maskln verify DUMPS/ [RESULTS/]``: a row per file, the failing files'
details, notes, the verdict line last; or JSON lines, one object per file.

The table fits the terminal at any width from 80 columns up: every row shows its file and its
verdict, and under a failing row what failed, unabridged (wrapped, never cut). The other
columns come by priority (the budget ratios of out, grad_x, grad_scale and grad_bias, the
module when the file name does not say it, the valid rows, the dtype) as many as fit; those
that do not are folded under each row as ``name value``. Off a terminal the table is laid out
for ``$COLUMNS`` columns, or :data:`PIPED_COLUMNS`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING

from maskln_cli.cli.report.consoles import closed_pipe_ends_quietly, plain_when_piped
from maskln_cli.cli.report.text import plain_safe, safe

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console
    from rich.text import Text

    from maskln_cli.verify.folder import FileVerdict, FolderReport

TENSORS = ("out", "grad_x", "grad_scale", "grad_bias")
SHOWN_FAILURES = 20
"""The failing files whose whole report is shown (all are in the table and the JSON)."""
PIPED_COLUMNS = 100
"""The width the table is laid out for off a terminal, unless ``$COLUMNS`` says one."""
GAP = 3
"""Spaces between two columns (and two before the first)."""
FOLD = 4
"""Indentation of what is folded under a row."""


def print_json_lines(report: FolderReport) -> None:
    """One JSON object per file, a line each (NaN and inf as null): a shard's lines and the
    next shard's concatenate into the whole folder's."""
    with closed_pipe_ends_quietly():
        for verdict in report.files:
            document = {"dumps": report.dumps, "results": report.results, **verdict.to_dict()}
            sys.stdout.write(json.dumps(_finite(document), ensure_ascii=True) + "\n")
        sys.stdout.flush()


def _finite(value: object) -> object:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def folder_verdict_line(report: FolderReport) -> str:
    """``PASS: all 40 files ...`` or ``FAIL: 2 of 40 files: ...`` as rich markup.

    Example:
        >>> from maskln_cli.verify.folder import FileVerdict, FolderReport
        >>> ok = FileVerdict("a.safetensors", "checked", True, module="ln")
        >>> folder_verdict_line(FolderReport("dumps", None, [ok], total=1))
        '[bold green]PASS[/]: the 1 file of dumps within its error budget'
    """
    files = report.files
    where = safe(report.dumps if report.results is None else report.results)
    of = f" (shard {report.shard[0]}/{report.shard[1]} of {report.total:,})" if report.shard else ""
    if not files:
        return f"[bold yellow]PASS[/]: no file in this shard{of}"
    failed = [f for f in files if not f.passed]
    if not failed:
        noun = "the 1 file" if len(files) == 1 else f"all {len(files):,} files"
        budget = "its error budget" if len(files) == 1 else "their error budgets"
        return f"[bold green]PASS[/]: {noun} of {where}{of} within {budget}"
    named = ", ".join(safe(_label(f)) for f in failed[:5])
    if len(failed) > 5:
        named += ", ..."
    return f"[bold red]FAIL[/]: {len(failed):,} of {len(files):,} files{of}: {named}"


def _label(verdict: FileVerdict) -> str:
    if verdict.status in ("missing", "extra", "error"):
        return f"{verdict.file} ({verdict.status})"
    return verdict.module or verdict.file


def render_folder(report: FolderReport, quiet: bool = False) -> None:
    """The human report: a table of files, each failing file's report, notes, the verdict."""
    from maskln_cli.cli.report.comparison import render_comparison

    with plain_when_piped() as console:
        if not quiet:
            if report.files:
                print_folder_table(console, report.files, _width(console))
            failing = [f for f in report.files if not f.passed]
            for verdict in failing[:SHOWN_FAILURES]:
                console.print()
                console.print(f"[bold]{safe(verdict.file)}[/]", soft_wrap=True)
                if verdict.report is not None:
                    render_comparison(verdict.report, quiet=False)
                else:
                    console.print(f"[bold red]{verdict.status}[/]: {safe(verdict.problem or '')}")
            if len(failing) > SHOWN_FAILURES:
                console.print(
                    f"[yellow]note:[/] {len(failing) - SHOWN_FAILURES:,} more failing files;"
                    " --json has every file's report",
                    soft_wrap=True,
                )
            for message in report.notes:
                console.print(f"[yellow]note:[/] {safe(message)}", soft_wrap=True)
            console.print()
        console.print(folder_verdict_line(report), soft_wrap=True)


def _width(console: Console) -> int:
    """The width to lay the table out for: the terminal's, else $COLUMNS or PIPED_COLUMNS."""
    if console.is_terminal:
        return console.width
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else PIPED_COLUMNS


@dataclass
class _Column:
    """A column of the table: its header, how a row's cell reads, and whether it is right
    justified."""

    header: str
    cell: Callable[[FileVerdict], str]
    right: bool = False


def folder_columns(files: list[FileVerdict]) -> list[_Column]:
    """The optional columns, by priority: the budget ratio of each tensor any file has, the
    module (when some file's name does not say it), the valid rows, the dtype."""
    columns = [
        _Column(name, lambda f, name=name: _ratio(f.budget_ratios, name), right=True)
        for name in TENSORS
        if any(name in f.budget_ratios for f in files)
    ]
    if any(f.module and f.module not in f.file for f in files):
        columns.append(_Column("module", lambda f: plain_safe(f.module or "")))
    columns.append(_Column("valid rows", _valid_rows, right=True))
    columns.append(_Column("dtype", lambda f: f.dtype or ""))
    return columns


def print_folder_table(console: Console, files: list[FileVerdict], width: int) -> None:
    """The table of ``files`` within ``width`` columns (see the module's docstring)."""
    from rich.text import Text

    optional = folder_columns(files)
    files_cells = [plain_safe(f.file) for f in files]
    verdicts = [_verdict_text(f) for f in files]
    file_width = max(len("file"), *(len(c) for c in files_cells))
    verdict_width = max(len("verdict"), *(len(v.plain) for v in verdicts))
    # The file column gives way (its names wrapped) only when it and the verdict cannot fit.
    file_width = max(12, min(file_width, width - 2 - GAP - verdict_width))
    used = 2 + file_width + GAP + verdict_width
    cells = {id(c): [c.cell(f) for f in files] for c in optional}
    shown: list[_Column] = []
    for column in optional:  # by priority, as long as they fit
        column_width = max(len(column.header), *(len(v) for v in cells[id(column)]))
        if used + GAP + column_width > width:
            break
        shown.append(column)
        used += GAP + column_width
    folded = [c for c in optional if c not in shown]
    widths = [max(len(c.header), *(len(v) for v in cells[id(c)])) for c in shown]
    lines: list[Text] = [Text(), _header(shown, widths, file_width, verdict_width)]
    lines.append(Text(" " + "─" * (used - 1)))
    for row, verdict in enumerate(files):
        name_lines = _wrap(files_cells[row], file_width, breaking=True)
        line = Text("  " + name_lines[0].ljust(file_width))
        for column, column_width in zip(shown, widths, strict=True):
            value = cells[id(column)][row]
            line.append(" " * GAP + (value.rjust if column.right else value.ljust)(column_width))
        line.append(" " * GAP)
        line.append_text(verdicts[row])
        lines.append(line)
        lines += [Text("  " + rest) for rest in name_lines[1:]]
        extra = [f"{c.header} {cells[id(c)][row]}" for c in folded if cells[id(c)][row]]
        for part in _wrap_items(extra, width - FOLD):
            lines.append(Text(" " * FOLD + part, style="dim"))
        for part in _wrap(what_failed(verdict), width - FOLD):
            lines.append(Text(" " * FOLD + part, style="red"))
    lines.append(Text())
    for line in lines:
        console.print(line, soft_wrap=True)
    if any(c.header in TENSORS for c in optional):
        note = (
            f"{'budget columns' if any(c.header in TENSORS for c in shown) else 'out, grad_x...'}:"
            " the worst element's share of what its error budget allows (FAIL above 1)"
        )
        for part in _wrap(note, width):
            console.print(part, style="dim", soft_wrap=True)


def _header(shown: list[_Column], widths: list[int], file_width: int, verdict_width: int) -> Text:
    from rich.text import Text

    text = "  " + "file".ljust(file_width)
    for column, column_width in zip(shown, widths, strict=True):
        header = column.header
        text += " " * GAP + (header.rjust if column.right else header.ljust)(column_width)
    text += " " * GAP + "verdict".ljust(verdict_width)
    return Text(text.rstrip(), style="bold")


def what_failed(verdict: FileVerdict) -> str:
    """What failed in a file, in one line: each failing tensor's explanation (grouped as the
    verdict line groups them), or why the file could not be judged; empty when it passed."""
    from maskln_cli.cli.report.comparison import and_list, explanations

    if verdict.passed:
        return ""
    if verdict.report is None:
        return plain_safe(verdict.problem or verdict.status)
    failed = [t for t in verdict.report.tensors if not t.passed]
    return "; ".join(
        f"{and_list(names)}: {plain_safe(what)}" for what, names in explanations(failed).items()
    )


def _wrap(text: str, width: int, breaking: bool = False) -> list[str]:
    """``text`` in lines of at most ``width`` (at least 20) columns, nothing cut: at spaces,
    and within a word longer than a line (``breaking``: anywhere, as a file name)."""
    if not text:
        return [""] if breaking else []
    width = max(20 if not breaking else 1, width)
    if breaking:
        return [text[i : i + width] for i in range(0, len(text), width)]
    return textwrap.wrap(text, width, break_on_hyphens=False) or [""]


def _wrap_items(items: list[str], width: int) -> list[str]:
    """``items`` two spaces apart, in lines of at most ``width`` columns, broken between items
    (an item longer than a line is wrapped alone).

    Example:
        >>> _wrap_items(["grad_bias 0.0347", "valid rows 11 of 14", "dtype float32"], 40)
        ['grad_bias 0.0347  valid rows 11 of 14', 'dtype float32']
    """
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + 2 + len(item) <= width:
            lines[-1] += f"  {item}"
        elif len(item) <= width:
            lines.append(item)
        else:
            lines += _wrap(item, width)
    return lines


def _valid_rows(verdict: FileVerdict) -> str:
    if verdict.rows is None:
        return ""
    valid = verdict.valid_rows if verdict.valid_rows is not None else verdict.rows
    return f"{valid:,} of {verdict.rows:,}"


def _ratio(ratios: dict[str, float | None], name: str) -> str:
    if name not in ratios:
        return ""
    value = ratios[name]
    return "-" if value is None else f"{value:.3g}"


def _verdict_text(verdict: FileVerdict) -> Text:
    from rich.text import Text

    if verdict.passed:
        word = f"PASS (plain {_norm_word(verdict)})" if verdict.plain_layer_norm else "PASS"
        return Text(word, style="bold green")
    word = "FAIL" if verdict.status == "checked" else f"FAIL: {verdict.status}"
    return Text(word, style="bold red")


def _norm_word(verdict: FileVerdict) -> str:
    """``LN`` or ``RMSNorm``: the plain norm a dump's model ran (by its report's yardstick)."""
    report = verdict.report
    yardstick = str(report.context.get("yardstick", "")) if report is not None else ""
    return "RMSNorm" if "rms_norm" in yardstick else "LN"
