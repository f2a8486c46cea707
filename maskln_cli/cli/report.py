"""What people read: rich tables, notes, errors and progress, from the plain data of the library.

Everything shown that came from a file (keys, metadata) goes through :func:`safe` first, so a
hostile file cannot inject terminal control sequences or rich markup; the consoles replace no
``:name:`` emoji codes, so ``enc:warning:w`` is shown as it is.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import sys
import time
import unicodedata
from collections.abc import Iterator
from typing import TYPE_CHECKING

from maskln_cli.compare.data import INTEGRAL_DTYPES, has_values, times
from maskln_cli.files.resources import human_bytes

if TYPE_CHECKING:
    from rich.console import Console
    from rich.segment import Segment
    from rich.style import Style
    from rich.table import Table
    from rich.text import Text

    from maskln_cli.compare.data import ComparisonReport, TensorComparison
    from maskln_cli.files.problem import Progress
    from maskln_cli.grading.runner import GradeReport
    from maskln_cli.jobs.inspect import FileSummary, TensorSummary
    from maskln_cli.jobs.normalize import NormalizeResult

PROGRESS_DELAY = 0.5
"""Seconds of work before a progress bar appears (on a terminal only)."""


@functools.cache
def stdout_console() -> Console:
    from rich.console import Console

    from maskln_cli.errors import MasklnError, StdoutClosed

    class StdoutConsole(Console):
        def on_broken_pipe(self) -> None:  # rich would exit 1: that means "mismatch" here
            self.quiet = True
            raise StdoutClosed

    if sys.stdout is None:
        raise MasklnError("<stdout>: is closed")
    # Off a terminal (a pipe, a file) nothing is wrapped to a guessed width of 80 columns.
    width = None if sys.stdout.isatty() else 400
    return StdoutConsole(highlight=False, soft_wrap=False, width=width, emoji=False)


@functools.cache
def stderr_console() -> Console:
    from rich.console import Console

    return Console(stderr=True, highlight=False, emoji=False)


def safe(text: object) -> str:
    r"""``text`` with control characters escaped (:func:`plain_safe`), as rich markup that
    shows it as it is, whatever markup comes before or after it.

    rich's own ``escape`` is not that: ``\[`` shows as ``[``, and a trailing backslash is
    doubled, or escapes a tag that follows. Here every ``[`` is written ``\[`` (a bracket,
    whatever follows it), and a run of backslashes before a bracket or at the end is doubled
    and closed by an empty ``[none][/none]`` (rich halves the backslashes before a tag).

    Example:
        >>> safe("key\x1b[2J[bold]")
        'key\\x1b\\[2J\\[bold]'
        >>> from rich.markup import render
        >>> [render(f"[bold]{safe(t)}[/]").plain for t in ("a\\[b]", "\\", "[x")]
        ['a\\[b]', '\\', '[x']
    """
    return _MARKUP_SPECIAL.sub(_escape_markup, plain_safe(text))


_MARKUP_SPECIAL = re.compile(r"(\\*)(\[|\Z)|(\\+)")


def _escape_markup(match: re.Match[str]) -> str:
    backslashes, bracket, other = match.groups()
    if other:  # backslashes before any other character are shown as they are
        return other
    closed = backslashes * 2 + "[none][/none]" if backslashes else ""
    return closed + ("\\[" if bracket else "")


def plain_safe(text: object) -> str:
    """``text`` with control characters escaped, for a rich ``Text`` (which reads no markup).

    Example:
        >>> plain_safe("key\\x1b[2J[bold]")
        'key\\\\x1b[2J[bold]'
    """
    text = str(text)
    if text.isascii() and text.isprintable():  # the usual key: nothing to escape
        return text
    return "".join(
        ch if unicodedata.category(ch) not in {"Cc", "Cf", "Zl", "Zp"} else _escape_char(ch)
        for ch in text
    )


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
    with _closed_pipe_ends_quietly():
        sys.stdout.write(to_json(data) + "\n")
        sys.stdout.flush()


@contextlib.contextmanager
def _closed_pipe_ends_quietly() -> Iterator[None]:
    from maskln_cli.errors import StdoutClosed

    try:
        yield
    except BrokenPipeError:
        raise StdoutClosed from None


def to_json(data: object) -> str:
    """Indented JSON, with lists of numbers (shapes, indices) kept on one line.

    Every string (a key, a metadata value) is encoded by the json module and nothing else
    touches it: ``"w[ 1,  2 ]"`` stays as it is.

    Example:
        >>> print(to_json({"shape": [2, 3], "max": float("inf"), "key": "w[ 1,  2 ]"}))
        {
          "shape": [2, 3],
          "max": null,
          "key": "w[ 1,  2 ]"
        }
    """
    return _encode(data, "")


def _encode(value: object, indent: str) -> str:
    """``json.dumps(value, indent=2)`` with NaN and inf as null, but for lists of numbers
    (and nulls), which stay on one line. Scalars are encoded as the json module encodes them
    (strings by its own encoder), without a json.dumps call each: a report of 10,000 tensors
    holds 400,000 of them."""
    kind = type(value)
    if kind is str:
        return _encode_string(value)  # type: ignore[arg-type]
    if kind is int:
        return int.__repr__(value)  # type: ignore[arg-type]
    if kind is float:
        return float.__repr__(value) if math.isfinite(value) else "null"  # type: ignore[arg-type]
    if value is None:
        return "null"
    if kind is bool:
        return "true" if value else "false"
    inner = indent + "  "
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = (f"{inner}{_encode_string(str(k))}: {_encode(v, inner)}" for k, v in value.items())
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    if isinstance(value, list | tuple):
        if not value:
            return "[]"
        if all(v is None or type(v) in (int, float) for v in value):  # not bool
            return "[" + ", ".join(_encode(v, inner) for v in value) + "]"
        return "[\n" + ",\n".join(inner + _encode(v, inner) for v in value) + f"\n{indent}]"
    if isinstance(value, float):
        return _encode(float(value), indent)
    return json.dumps(value)  # what the json module makes of it, or its TypeError


_encode_string = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]
"""What json.dumps does with a string (``ensure_ascii``, the default)."""


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
    from rich.cells import cell_len
    from rich.table import Table
    from rich.text import Text

    # The file name is a line of its own: as the table's title it would wrap at the table's
    # width, and a long path would be cut in two (keys stay whole, to be copied; so does it).
    table = Table(box=box.SIMPLE_HEAD)
    # Keys stay whole, to be copied; only the values column wraps on a narrow terminal.
    table.add_column("key", style="bold", no_wrap=True)
    table.add_column("dtype", no_wrap=True)
    table.add_column("shape", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    if not summary.keys_only:
        table.add_column("values")
    rows: list[list[str | Text]] = []
    for tensor in summary.tensors:
        # Plain cells: markup parsing is much of what rich spends on a row (the key is escaped
        # by plain_safe instead); values hold markup only for NaN and inf counts.
        row: list[str | Text] = [
            plain_safe(tensor.name),
            tensor.dtype,
            "\N{MULTIPLICATION SIGN}".join(map(str, tensor.shape)) or "scalar",
            human_bytes(tensor.bytes),
        ]
        if not summary.keys_only:
            values = describe_values(tensor)
            row.append(Text.from_markup(values, emoji=False) if "[" in values else values)
        rows.append(row)
    with plain_when_piped() as console:
        console.print(safe(summary.file), soft_wrap=True)
        if not print_simple_table(console, table, rows):
            for row in rows:
                table.add_row(*(Text(c) if isinstance(c, str) else c for c in row))
            console.print(table)
        if summary.keys_only or summary.patterns:
            console.print(_key_count(summary), soft_wrap=True)
            console.print()
        if summary.metadata:
            # A title over an indented grid, laid out as a box.SIMPLE table without a header
            # was, but for that table's blank bottom edge: it ended the output with a blank.
            console.print("metadata", style="table.title")
            console.print()
            # Plain lines, not a rich grid, which folded a key like ':warning::warning:' (the
            # fuzz tests found it): each key bold, padded to the longest, then its value.
            keys = {key: plain_safe(key) for key in summary.metadata}
            width = max(cell_len(shown) for shown in keys.values())
            for key in sorted(summary.metadata):
                line = Text("  ")
                line.append(keys[key], style="bold")
                line.append(" " * (width - cell_len(keys[key]) + 3))
                line.append(plain_safe(summary.metadata[key]))
                line.rstrip()
                console.print(line, soft_wrap=True)
        else:
            console.print("no metadata", style="dim")


def print_table(console: Console, table: Table, pending: list[Segment] | None = None) -> None:
    """``console.print(table)``, fast for the tables and grids reports are made of (see
    :func:`print_simple_table`): a diff where 8,000 tensors fail prints 16,000 of them. With
    ``pending``, the table's segments are added to it, to be printed with others (and what it
    holds is printed first if rich must lay the table out).
    """
    from rich.text import Text

    rows: list[list[str | Text]] = []
    for cells in zip(*(column.cells for column in table.columns), strict=True):
        if not all(isinstance(cell, str | Text) for cell in cells):
            rows = []
            break
        rows.append([_markup(console, c) if isinstance(c, str) else c for c in cells])
    if not (rows and print_simple_table(console, table, rows, filled=True, pending=pending)):
        _flush(console, pending or [])
        console.print(table)


def _markup(console: Console, text: str) -> str | Text:
    """A table's str cell as rich shows it: markup (and emoji codes, on a console that
    replaces them), unless it has neither."""
    return console.render_str(text, highlight=False) if "[" in text or ":" in text else text


def print_simple_table(
    console: Console,
    table: Table,
    rows: list[list[str | Text]],
    filled: bool = False,
    pending: list[Segment] | None = None,
) -> bool:
    """Print ``table`` holding ``rows`` (cells of plain text, or Text; the table is given
    without them unless ``filled``) as rich would; or print nothing and return False unless
    it is a ``SIMPLE_HEAD`` table with a header (and a left-justified title or none), or a
    grid (``Table.grid``), whose rows fit the console's width unwrapped. With ``pending``,
    the segments are added to it instead of printed.

    rich lays a table out cell by cell, at about 0.6 ms a row: 6 s for the inspect table of
    10,000 tensors. These are simple (every column as wide as its widest cell and its padding,
    the same characters at the edges and between columns), so they are built here as
    segments, with the title's, the header's and the columns' styles.

    Example:
        >>> from rich import box
        >>> from rich.console import Console
        >>> from rich.table import Table
        >>> table = Table(box=box.SIMPLE_HEAD)
        >>> table.add_column("key"); table.add_column("size", justify="right")
        >>> console = Console(width=40, color_system=None)
        >>> with console.capture() as capture:
        ...     print_simple_table(console, table, [["weight", "12 B"]])
        True
        >>> [line.rstrip() for line in capture.get().splitlines()]
        ['', '  key      size', ' ───────────────', '  weight   12 B', '']
    """
    from rich import box
    from rich.segment import Segment, Segments
    from rich.style import Style
    from rich.text import Span, Text

    columns = table.columns
    cells = [[(c, []) if isinstance(c, str) else (c.plain, c.spans) for c in row] for row in rows]
    headed = table.box is box.SIMPLE_HEAD and table.show_header and table.show_edge
    grid = table.box is None and not table.show_header and not table.show_edge
    simple = (
        (headed or grid) and not table.show_footer and not table.show_lines
        and not table.expand and table.width is None and table.min_width is None
        and not table.caption and table.style in ("", "none") and not table.row_styles
        and not table.border_style and table.header_style == "table.header"
        and not table.highlight and console.encoding.lower().startswith("utf")
        and not console.legacy_windows and columns and (filled or not columns[0]._cells)
        and (not table.title or (isinstance(table.title, str) and table.title_justify == "left"))
        and all(isinstance(c.header, str) and not c.header_style and c.justify in ("left", "right")
                and c.width is None and c.min_width is None and c.max_width is None
                and c.ratio is None and not c.highlight for c in columns)
        and all(len(row) == len(columns) for row in cells)
        and not any("\n" in text or "\t" in text for row in cells for text, _ in row)
    )  # fmt: skip
    if not simple:
        return False
    count = len(columns)
    # Each column's padding, as rich works it out (Table._get_cells).
    top, right_pad, bottom, left_pad = table.padding
    pads = []
    for i in range(count):
        left, right = left_pad, right_pad
        if table.collapse_padding and i:
            left = max(0, left - right)
        if not table.pad_edge:
            left = 0 if i == 0 else left
            right = 0 if i == count - 1 else right
        pads.append((left, right))
    if top or bottom:
        return False
    widths = [_cells(c.header) if headed else 0 for c in columns]
    for row in cells:
        widths = [max(w, _cells(text)) for w, (text, _) in zip(widths, row, strict=True)]
    padded = [w + left + right for w, (left, right) in zip(widths, pads, strict=True)]
    edge, between = (" ", " ") if headed else ("", "")
    table_width = sum(padded) + len(between) * (count - 1) + 2 * len(edge)
    if table_width > console.width:
        return False  # rich would wrap a column: let it
    segments: list[Segment] = []
    if table.title:
        title = console.render_str(
            table.title, style=Style.pick_first(table.title_style, "table.title"), highlight=False
        )
        if "\n" in title.plain or _cells(title.plain) > table_width:
            return False  # rich would wrap it
        options = console.options.update(width=table_width, justify="left", highlight=False)
        segments += console.render(title, options)  # one line, padded, as Table renders it
    styled = console.color_system is not None  # else rich writes no styles at all
    styles = [console.get_style(c.style) if c.style else None for c in columns]
    right = [c.justify == "right" for c in columns]
    line = Segment.line()

    def add_line(row: list[tuple[str, list[Span]]], row_styles: list[Style | None]) -> None:
        plain = [edge]
        for i, (text, text_spans) in enumerate(row):
            if right[i]:  # rich strips trailing spaces before it justifies right
                text = text.rstrip()
            pad = widths[i] - _cells(text)
            left, after = (
                (pads[i][0] + pad, pads[i][1]) if right[i] else (pads[i][0], pad + pads[i][1])
            )
            if not styled:
                plain.append(f"{' ' * left}{text}{' ' * after}{between if i < count - 1 else edge}")
                continue
            style = row_styles[i]
            segments.append(Segment("".join(plain)))
            if text_spans:
                segments.append(Segment(" " * left, style))
                spans = [Span(s.start, min(s.end, len(text)), s.style) for s in text_spans]
                segments.extend(Text(text, style=style or "", spans=spans).render(console))
                segments.append(Segment(" " * after, style))
            else:
                segments.append(Segment(f"{' ' * left}{text}{' ' * after}", style))
            plain = [between if i < count - 1 else edge]
        segments.extend((Segment("".join(plain)), line))

    if headed:
        segments += [Segment(" " * table_width), line]
        header = console.get_style("table.header")
        add_line([(c.header, []) for c in columns], [header] * count)
        segments += [
            Segment(" " + "\N{BOX DRAWINGS LIGHT HORIZONTAL}" * (table_width - 2) + " "),
            line,
        ]
    for row in cells:
        add_line(row, styles)
    if headed:
        segments += [Segment(" " * table_width), line]
    if pending is None:
        console.print(Segments(segments), soft_wrap=True)
    else:
        pending += segments
    return True


def _cells(text: str) -> int:
    """Columns ``text`` takes on a terminal (rich's measure; printable ASCII at once)."""
    if text.isascii() and text.isprintable():
        return len(text)
    from rich.cells import cell_len

    return cell_len(text)


def _key_count(summary: FileSummary) -> str:
    """``12 of 199 tensors match '*norm*', 36.0 KiB`` (or ``199 tensors, 417.7 MiB``)."""
    size = human_bytes(sum(t.bytes for t in summary.tensors))
    tensors = "tensor" if summary.keys_total == 1 else "tensors"
    if not summary.patterns:
        return f"{summary.keys_total:,} {tensors}, {size}"
    patterns = " or ".join(safe(repr(p)) for p in summary.patterns)
    verb = "matches" if len(summary.tensors) == 1 else "match"
    return f"{len(summary.tensors):,} of {summary.keys_total:,} {tensors} {verb} {patterns}, {size}"


def describe_values(tensor: TensorSummary) -> str:
    """The values column of ``maskln inspect``, as rich markup.

    Example:
        >>> from maskln_cli.jobs.inspect import TensorSummary
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
        f" ({result.eps_source})"
    )


@contextlib.contextmanager
def progress_bar(description: str, enabled: bool = True) -> Iterator[Progress]:
    """A progress callback; a rich bar appears on stderr once the work has taken a moment.

    Nothing is drawn when stderr is not a terminal (pipelines and logs stay clean), nor when
    ``enabled`` is False (``--quiet``).
    """
    console = stderr_console()
    started = time.monotonic()
    bar = None
    task = None

    def update(done: int, total: int) -> None:
        nonlocal bar, task
        if bar is None:
            if not enabled or not console.is_terminal:
                return
            if time.monotonic() - started < PROGRESS_DELAY:
                return
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            bar = Progress(
                TextColumn("{task.description}", markup=False),  # a path, shown as it is
                BarColumn(),
                TextColumn("{task.percentage:>3.0f}%"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
                transient=True,
            )
            bar.start()
            task = bar.add_task(plain_safe(description), total=total)
        bar.update(task, completed=done, total=total)

    try:
        yield update
    finally:
        if bar is not None:
            bar.stop()


def verdict_line(report: ComparisonReport) -> str:
    """``PASS: ...`` or ``FAIL: ...``, naming the tensors, as rich markup.

    Example:
        >>> from maskln_cli.compare.data import ComparisonReport, TensorComparison
        >>> ok = TensorComparison("out", True, [], [2], [2], "float32", "float32", 1e-5, 1e-5)
        >>> verdict_line(ComparisonReport("diff", "a", "b", [ok]))
        '[bold green]PASS[/]: out within tolerance'
    """
    failed = [t for t in report.tensors if not t.passed]
    if not report.tensors:
        return "[bold yellow]PASS[/]: nothing to compare"
    if not failed:
        names = ", ".join(safe(t.name) for t in report.tensors[:8])
        if len(report.tensors) > 8:
            names = f"{len(report.tensors):,} tensors ({names}, ...)"
        return f"[bold green]PASS[/]: {names} {_within(report)}"
    described = "; ".join(f"{safe(t.name)} ({safe(t.problems[0])})" for t in failed)
    return f"[bold red]FAIL[/]: {len(failed)} of {len(report.tensors)} tensors: {described}"


def _within(report: ComparisonReport) -> str:
    context = report.context
    if context.get("tolerance") == "budget":
        return f"within the {context.get('result_dtype')} error budget"
    if all(compared_exactly(tensor) for tensor in report.tensors):
        return "equal (compared exactly)"  # no tolerance was involved
    return "within tolerance"


COMPACT_AFTER = 8
"""With more tensors than this, those that pass get one line each instead of a block."""


def render_comparison(report: ComparisonReport, quiet: bool = False) -> None:
    """The human report of ``maskln diff`` and ``maskln verify``: a header, a block per tensor,
    the worst rows of each mismatched tensor, notes, and the verdict line last."""
    from rich.segment import Segment

    with plain_when_piped() as console:
        if not quiet:
            _render_header(console, report)
            compact = len(report.tensors) > COMPACT_AFTER
            if compact:
                console.print()
            # Lines and tables are printed at once: a print each was much of what a report of
            # 10,000 tensors took.
            pending: list[Segment] = []
            # A worst-rows table ends with its blank bottom edge: one blank line between
            # sections, so no other is added after it.
            after_blank = compact
            for tensor in report.tensors:
                if compact and tensor.passed:
                    pending += _tensor_line(tensor)
                    after_blank = False
                    continue
                if not after_blank:
                    pending.append(Segment.line())
                print_table(console, _tensor_block(tensor, report), pending)
                after_blank = False
                if tensor.worst and not tensor.passed:
                    pending.append(Segment.line())
                    print_table(console, _worst_rows_table(tensor, report), pending)
                    after_blank = True
            _flush(console, pending)
            for message in report.notes:
                console.print(f"[yellow]note:[/] {safe(message)}", soft_wrap=True)
                after_blank = False
            if not after_blank:
                console.print()
        console.print(verdict_line(report), soft_wrap=True)


@contextlib.contextmanager
def plain_when_piped() -> Iterator[Console]:
    """The stdout console; off a terminal what is printed is captured and written with the
    spaces that pad table cells stripped from line ends (a terminal hides them; a file, a
    pager or ``diff`` would not)."""
    console = stdout_console()
    if console.is_terminal:
        yield console
        return
    with console.capture() as capture:
        yield console
    text = "\n".join(line.rstrip() for line in capture.get().split("\n"))
    with _closed_pipe_ends_quietly():
        console.file.write(text)
        console.file.flush()


def _render_header(console: Console, report: ComparisonReport) -> None:
    if report.command != "verify":
        console.print(f"[bold]actual[/]    {safe(report.actual)}", soft_wrap=True)
        console.print(f"[bold]expected[/]  {safe(report.expected)}", soft_wrap=True)
        return
    context = report.context
    dtype = context.get("result_dtype")
    rows, valid = context.get("rows"), context.get("valid_rows")
    assert isinstance(rows, int) and isinstance(valid, int)
    lines = [
        ("result", f"{safe(report.actual)} (actual)"),
        ("reference", f"maskln in float64, from {safe(report.expected)} (expected)"),
        ("eps", f"{context.get('eps')!r}, {_eps_origin(context.get('eps_source'))}"),
        ("rows", f"{valid:,} valid and {rows - valid:,} invalid, of {rows:,}"),
    ]
    if context.get("tolerance") == "budget":
        judged = (
            f"as a {dtype} kernel: within {context.get('factor'):g}x a model of {dtype} rounding"
            f" (--factor), checked against PyTorch's F.layer_norm in {dtype}"
        )
    else:
        judged = "by a fixed tolerance: |actual - expected| <= atol + rtol * |expected|"
    lines.append(("judged", judged))
    grid = _grid()
    for label, value in lines:
        grid.add_row(label, value)
    console.print(grid)


def _grid() -> Table:
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    return grid


def _tensor_block(tensor: TensorComparison, report: ComparisonReport) -> object:
    verify = report.command == "verify"
    verdict = "[bold green]PASS[/]" if tensor.passed else "[bold red]FAIL[/]"
    grid = _grid()
    grid.add_row(f"{verdict} {safe(tensor.name)}", _shapes(tensor, verify))
    for problem in tensor.problems:
        grid.add_row("  problem", f"[red]{safe(problem)}[/]")
    for found in tensor.diagnosis:
        grid.add_row("  diagnosis", f"likely {safe(found['description'])}; {safe(found['fix'])}")
    if tensor.mismatched is not None:
        grid.add_row("  mismatched", _mismatched(tensor))
        if tensor.rows_left_out is not None:
            grid.add_row("  left out", f"{tensor.rows_left_out:,} rows (--valid)")
        if verify:
            _error_rows(grid, tensor, report)
        else:
            grid.add_row("  max abs diff", _at(tensor.max_abs_diff, tensor.max_abs_index))
        grid.add_row("  max rel diff", _at(tensor.max_rel_diff, tensor.max_rel_index))
        if not verify:
            grid.add_row(
                "  rel L2 error", number(tensor.rel_l2) if tensor.rel_l2 is not None else ""
            )
        grid.add_row("  NaN/inf", _nonfinite(tensor, verify))
    if tensor.invalid_rows_zero is not None or tensor.negative_zeros:
        grid.add_row("  padding", _padding(tensor))
    exactly = compared_exactly(tensor)
    if exactly is not None:  # "rtol 0, atol 0" would read as a tolerance chosen to be 0
        if exactly:
            grid.add_row("  compared", exactly)
    elif tensor.rtol == tensor.rtol:  # not NaN: a tolerance applied
        label = "  always allowed" if report.context.get("tolerance") == "budget" else "  tolerance"
        extra = ", 2 ulps" if report.context.get("tolerance") == "budget" else ""
        if INTEGRAL_DTYPES.issuperset((tensor.dtype, tensor.expected_dtype)):
            extra = ", exactly"  # integers within a tolerance, in their exact values
        grid.add_row(label, f"rtol {tensor.rtol:g}, atol {tensor.atol:g}{extra}")
    return grid


def compared_exactly(tensor: TensorComparison) -> str | None:
    """How a tensor compared without any tolerance was compared, for the report: integers
    and bool (unless a tolerance was given) exactly in their values, dtypes without a float64
    form bit for bit (empty when their values were not compared); None when a tolerance applied.

    Example:
        >>> from maskln_cli.compare.data import TensorComparison
        >>> mask = TensorComparison("valid", True, [], [2], [2], "bool", "bool", 0.0, 0.0)
        >>> compared_exactly(mask)
        'exactly (bool: no tolerance applies)'
    """
    dtypes = (tensor.dtype, tensor.expected_dtype)
    if None in dtypes:  # missing on one side: nothing was compared
        return None
    if not all(has_values(dtype) for dtype in dtypes):
        same = tensor.dtype == tensor.expected_dtype and tensor.shape == tensor.expected_shape
        return f"bit for bit, as stored ({tensor.dtype} has no float64 form)" if same else ""
    if INTEGRAL_DTYPES.issuperset(dtypes) and not (tensor.rtol or tensor.atol):
        kind = "bool" if dtypes == ("bool", "bool") else "integers"
        return f"exactly ({kind}: no tolerance applies)"
    return None


def _mismatched(tensor: TensorComparison) -> str:
    """``N of M (p%), in R of S rows``, over the rows compared (those --valid kept)."""
    numel, rows = tensor.numel or 0, tensor.rows
    if tensor.rows_left_out and rows:
        numel -= tensor.rows_left_out * (numel // rows)
        rows -= tensor.rows_left_out
    share = 100 * (tensor.mismatched_fraction or 0.0)
    text = f"{tensor.mismatched:,} of {numel:,} ({share:.3g}%)"
    if rows is not None and tensor.rows != tensor.numel:
        text += f", in {tensor.mismatched_rows:,} of {rows:,} rows"
    return text


def _error_rows(grid: Table, tensor: TensorComparison, report: ComparisonReport) -> None:
    """verify: the kernel's error and PyTorch's beside it, their ratio, and the budget."""
    dtype = report.context.get("result_dtype")
    kernel = (
        f"max abs {_at(tensor.max_abs_diff, tensor.max_abs_index)}, rel L2 {number(tensor.rel_l2)}"
    )
    nonfinite = (tensor.nan_where_finite or 0) + (tensor.inf_where_finite or 0)
    if nonfinite:  # a NaN is no difference of 0: say which elements the figures cover
        kernel += f" [red](finite elements only: {nonfinite:,} are NaN or inf)[/]"
    grid.add_row("  error", kernel)
    yard_max, yard_l2 = tensor.yardstick_max_abs_diff, tensor.yardstick_rel_l2
    if yard_max is not None:
        grid.add_row(f"  PyTorch {dtype}", f"max abs {number(yard_max)}, rel L2 {number(yard_l2)}")
        ratios = [
            (name, _ratio(ours, theirs))
            for name, ours, theirs in (
                ("max abs", tensor.max_abs_diff, yard_max),
                ("rel L2", tensor.rel_l2, yard_l2),
            )
        ]
        shown = ", ".join(f"{value} ({name})" for name, value in ratios if value)
        if shown:
            grid.add_row("  vs PyTorch", f"{shown} as far from float64")
    if tensor.budget_ratio is not None:
        what = "budget" if report.context.get("tolerance") == "budget" else "tolerance"
        ratio = tensor.budget_ratio
        text = (
            f"{ratio:.3g} of what its {what} allows"
            if ratio <= 1
            else f"[red]{times(ratio)} what its {what} allows[/]"
        )
        # Invalid rows are judged by being exactly 0, not by the budget: when they fail, this
        # figure (of the valid rows) must not read as the failure's size.
        label = "worst valid element" if tensor.invalid_rows_zero is False else "worst element"
        grid.add_row(f"  {label}", text)


def _ratio(ours: float | None, theirs: float | None) -> str:
    if ours is None or theirs is None or not math.isfinite(ours):
        return ""
    if theirs == 0:
        return "exact, as PyTorch's" if ours == 0 else ""
    return times(ours / theirs)


def _nonfinite(tensor: TensorComparison, verify: bool) -> str:
    if not verify:
        text = f"NaN {tensor.nan_mismatched:,}, inf {tensor.inf_mismatched:,}"
        return f"[red]{text}[/]" if tensor.nan_mismatched or tensor.inf_mismatched else text
    if not (tensor.nan_mismatched or tensor.inf_mismatched):
        return "none where the reference is finite"
    return (
        f"[red]disagree with the reference: NaN at {tensor.nan_mismatched:,} elements, inf at"
        f" {tensor.inf_mismatched:,}[/]"
    )


def _padding(tensor: TensorComparison) -> str:
    if tensor.invalid_rows_zero is False:
        return "[red]not all exactly 0 at invalid positions[/]"
    if tensor.negative_zeros:
        return (
            f"[yellow]-0.0 at {tensor.negative_zeros:,} padded positions[/] (+0.0 expected;"
            " --strict fails it)"
        )
    return "exactly +0.0 at every invalid position"


def _tensor_line(tensor: TensorComparison) -> list[Segment]:
    """One line for a tensor that passed, in a long report, as segments: a report may hold
    10,000 of them, and parsing each one's markup took longer than comparing the tensor."""
    from rich.segment import Segment

    figures = ""
    if tensor.max_abs_diff is not None:
        figures = f"  max abs diff {number(tensor.max_abs_diff)}, rel L2 {number(tensor.rel_l2)}"
    if tensor.rows_left_out:
        figures += f", {tensor.rows_left_out:,} rows left out"
    return [
        Segment("PASS", _style("bold green")),
        Segment(" "),
        Segment(plain_safe(tensor.name), _style("bold")),
        Segment(f"  {_shapes(tensor)}{figures}"),
        Segment.line(),
    ]


@functools.cache
def _style(definition: str) -> Style:
    from rich.style import Style

    return Style.parse(definition)


def _flush(console: Console, pending: list[Segment]) -> None:
    """Print ``pending`` (segments ending in a new line) at once, and empty it."""
    if pending:
        from rich.segment import Segments

        console.print(Segments(pending), soft_wrap=True)
        pending.clear()


def _shapes(tensor: TensorComparison, verify: bool = False) -> str:
    def side(dtype: str | None, shape: list[int] | None) -> str:
        return "missing" if dtype is None else f"{dtype} {shape}"

    actual = side(tensor.dtype, tensor.shape)
    if verify:  # the reference is float64 by design: only its shape can tell
        if tensor.shape == tensor.expected_shape or tensor.expected_shape is None:
            return actual
        return f"{actual}, reference {tensor.expected_shape}"
    expected = side(tensor.expected_dtype, tensor.expected_shape)
    return actual if actual == expected else f"actual {actual}, expected {expected}"


def _at(value: float | None, index: list[int] | None) -> str:
    if value is None:
        return "no finite pair"
    if value == 0:
        return "0"
    return f"{number(value)} at {index}"


def _worst_rows_table(tensor: TensorComparison, report: ComparisonReport) -> object:
    from rich import box
    from rich.table import Table

    allowed = "budget" if report.context.get("tolerance") == "budget" else "tolerance"
    exactly = compared_exactly(tensor) is not None  # no tolerance: its column stays empty
    table = Table(
        title=f"worst rows of {safe(tensor.name)}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
    )
    table.add_column("row")
    table.add_column("channel", justify="right")
    table.add_column("actual", justify="right")
    table.add_column("expected", justify="right")
    table.add_column("abs diff", justify="right")
    table.add_column("" if exactly else allowed, justify="right")
    table.add_column("")
    for position, worst in enumerate(tensor.worst):
        # The last row may be the max abs diff's, added when not among the worst.
        label = ""
        if position == len(tensor.worst) - 1 and worst.index == tensor.max_abs_index:
            within = worst.allowed is not None and worst.abs_diff <= worst.allowed
            label = f"max abs diff{f', within its {allowed}' if within else ''}"
        table.add_row(
            str(worst.row),
            "" if worst.row == worst.index else str(worst.index[-1]),
            _value(worst.actual, ".7g"),
            _value(worst.expected, ".7g"),
            _value(worst.abs_diff, ".3g") if math.isfinite(worst.abs_diff) else "not finite",
            "" if worst.allowed is None or exactly else f"{worst.allowed:.3g}",
            label,
        )
    return table


def _eps_origin(source: object) -> str:
    """Where eps came from, as the header says it: ``the default``, ``from --eps``...

    Example:
        >>> _eps_origin("default"), _eps_origin("metadata 'eps'")
        ('the default', "from metadata 'eps'")
    """
    return "the default" if source == "default" else f"from {safe(source)}"


def _value(value: float | int, spec: str) -> str:
    """A value of the worst rows: an integer exactly, a float to ``spec``."""
    return f"{value:,}" if isinstance(value, int) else format(value, spec)


def render_grade(report: GradeReport, quiet: bool = False) -> None:
    """The human report of ``maskln grade``: a line per clause (verdict, name, level, time),
    under a failing one its first counterexample or reason, then the diagnosis, then the
    verdict line. Everything the graded function said (exception messages) is escaped."""
    from maskln_cli.grading.runner import diagnosis_lines

    console = stdout_console()
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
