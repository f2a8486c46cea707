"""What people read: rich tables, notes, errors and progress, from the plain data of the library.

Everything shown that came from a file (keys, metadata) goes through :func:`safe` first, so a
hostile file cannot inject terminal control sequences or rich markup.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
import unicodedata
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from maskln_cli.normalize import NormalizeResult, Progress
    from maskln_cli.stats import FileSummary, TensorSummary

PROGRESS_DELAY = 0.5
"""Seconds of work before a progress bar appears (on a terminal only)."""


@functools.cache
def stdout_console() -> Console:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False)


@functools.cache
def stderr_console() -> Console:
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def safe(text: object) -> str:
    """``text`` with control characters escaped and rich markup neutralized.

    Example:
        >>> safe("key\\x1b[2J[bold]")
        'key\\\\x1b[2J\\\\[bold]'
    """
    from rich.markup import escape

    shown = "".join(
        ch if unicodedata.category(ch) not in {"Cc", "Cf", "Zl", "Zp"} else _escape_char(ch)
        for ch in str(text)
    )
    return escape(shown)


def _escape_char(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def error(message: str) -> None:
    """One line on stderr: ``maskln: error: <message>``."""
    stderr_console().print(f"[bold red]maskln: error:[/] {safe(message)}", soft_wrap=True)


def note(message: str) -> None:
    """One informational line on stderr."""
    stderr_console().print(f"[dim]maskln:[/] {safe(message)}", soft_wrap=True)


def print_json(data: object) -> None:
    """A JSON document on stdout (plain, never styled, NaN and inf as null)."""
    sys.stdout.write(json.dumps(_json_safe(data), indent=2) + "\n")
    sys.stdout.flush()


def _json_safe(value: object) -> object:
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def human_bytes(count: int) -> str:
    """``1536`` -> ``'1.5 KiB'``.

    Example:
        >>> human_bytes(1536), human_bytes(12)
        ('1.5 KiB', '12 B')
    """
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def number(value: float | int | None) -> str:
    """A compact number for tables: ints with separators, floats to 4 significant digits."""
    if value is None:
        return ""
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4g}"


def render_file_summary(summary: FileSummary) -> None:
    """The ``maskln inspect`` table: a row per tensor (what it is, then its values), metadata."""
    from rich import box
    from rich.table import Table

    table = Table(title=safe(summary.file), title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("key", style="bold", overflow="fold")
    table.add_column("dtype")
    table.add_column("shape")
    table.add_column("size", justify="right")
    table.add_column("values")
    for tensor in summary.tensors:
        table.add_row(
            safe(tensor.name),
            tensor.dtype,
            "\N{MULTIPLICATION SIGN}".join(map(str, tensor.shape)) or "scalar",
            human_bytes(tensor.bytes),
            describe_values(tensor),
        )
    console = stdout_console()
    console.print(table)
    if summary.metadata:
        meta = Table(title="metadata", title_justify="left", box=box.SIMPLE, show_header=False)
        meta.add_column("key", style="bold", overflow="fold")
        meta.add_column("value", overflow="fold")
        for key in sorted(summary.metadata):
            meta.add_row(safe(key), safe(summary.metadata[key]))
        console.print(meta)
    else:
        console.print("no metadata", style="dim")


def describe_values(tensor: TensorSummary) -> str:
    """The values column of ``maskln inspect``, as rich markup.

    Example:
        >>> from maskln_cli.stats import TensorSummary
        >>> describe_values(TensorSummary("m", "bool", [4], 4, 4, true=3))
        '3 of 4 true (75.0%)'
    """
    if tensor.true is not None:
        share = f" ({100 * tensor.true / tensor.numel:.1f}%)" if tensor.numel else ""
        return f"{tensor.true:,} of {tensor.numel:,} true{share}"
    parts = [
        f"{name}={number(value)}"
        for name, value in (
            ("min", tensor.min),
            ("max", tensor.max),
            ("mean", tensor.mean),
            ("std", tensor.std),
        )
        if value is not None
    ]
    if tensor.numel and tensor.min is None and tensor.nan is None:
        parts.append("no statistics for this dtype")
    nonfinite = [(n, c) for n, c in (("NaN", tensor.nan), ("inf", tensor.inf)) if c]
    parts += [f"[red]{name}={count:,}[/]" for name, count in nonfinite]
    return "  ".join(parts)


def render_normalize_result(result: NormalizeResult) -> None:
    """One line on stderr saying what was written."""
    keys = ", ".join(result.keys)
    note(
        f"wrote {result.output}: {keys} {list(result.shape)} {result.dtype}, "
        f"{result.valid_rows:,} of {result.rows:,} positions valid, eps {result.eps!r}"
    )


@contextlib.contextmanager
def progress_bar(description: str) -> Iterator[Progress]:
    """A progress callback; a rich bar appears on stderr once the work has taken a moment.

    Nothing is drawn when stderr is not a terminal (pipelines and logs stay clean).
    """
    console = stderr_console()
    started = time.monotonic()
    bar = None
    task = None

    def update(done: int, total: int) -> None:
        nonlocal bar, task
        if bar is None:
            if not console.is_terminal or time.monotonic() - started < PROGRESS_DELAY:
                return
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.percentage:>3.0f}%"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
                transient=True,
            )
            bar.start()
            task = bar.add_task(safe(description), total=total)
        bar.update(task, completed=done, total=total)

    try:
        yield update
    finally:
        if bar is not None:
            bar.stop()
