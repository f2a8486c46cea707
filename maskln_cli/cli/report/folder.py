"""The report of ``maskln verify DUMPS/ [RESULTS/]``: a row per file, the failing files'
details, notes, the verdict line last; or JSON lines, one object per file."""

from __future__ import annotations

import json
import math
import sys
from typing import TYPE_CHECKING

from maskln_cli.cli.report.consoles import closed_pipe_ends_quietly, plain_when_piped
from maskln_cli.cli.report.tables import print_simple_table
from maskln_cli.cli.report.text import plain_safe, safe

if TYPE_CHECKING:
    from rich.text import Text

    from maskln_cli.verify.folder import FileVerdict, FolderReport

TENSORS = ("out", "grad_x", "grad_scale", "grad_bias")
SHOWN_FAILURES = 20
"""The failing files whose whole report is shown (all are in the table and the JSON)."""


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
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from maskln_cli.cli.report.comparison import render_comparison

    with plain_when_piped() as console:
        if not quiet:
            shown = [t for t in TENSORS if any(t in f.budget_ratios for f in report.files)]
            table = Table(box=box.SIMPLE_HEAD)
            for column in ("file", "module", "rows", "valid", "dtype"):
                justify = "right" if column in ("rows", "valid") else "left"
                table.add_column(column, no_wrap=True, justify=justify)  # type: ignore[arg-type]
            for name in shown:
                table.add_column(name, justify="right", no_wrap=True)
            table.add_column("verdict", no_wrap=True)
            rows: list[list[str | Text]] = []
            for verdict in report.files:
                row: list[str | Text] = [
                    plain_safe(verdict.file),
                    plain_safe(verdict.module or ""),
                    f"{verdict.rows:,}" if verdict.rows is not None else "",
                    f"{verdict.valid_rows:,}" if verdict.valid_rows is not None else "",
                    verdict.dtype or "",
                ]
                row += [_ratio(verdict.budget_ratios, name) for name in shown]
                row.append(_verdict_cell(verdict))
                rows.append(row)
            if rows and not print_simple_table(console, table, rows):
                for row in rows:
                    table.add_row(*(Text(c) if isinstance(c, str) else c for c in row))
                console.print(table)
            if shown:
                console.print(
                    "budget columns: the worst element's share of what its error budget allows"
                    " (FAIL above 1)",
                    style="dim",
                    soft_wrap=True,
                )
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


def _ratio(ratios: dict[str, float | None], name: str) -> str:
    if name not in ratios:
        return ""
    value = ratios[name]
    return "-" if value is None else f"{value:.3g}"


def _verdict_cell(verdict: FileVerdict) -> Text:
    from rich.text import Text

    if verdict.passed:
        word = "PASS (plain LN)" if verdict.plain_layer_norm else "PASS"
        return Text(word, style="bold green")
    word = "FAIL" if verdict.status == "checked" else f"FAIL: {verdict.status}"
    return Text(word, style="bold red")
