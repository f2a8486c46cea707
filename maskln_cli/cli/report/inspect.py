"""The report of ``maskln inspect``: a table of a file's tensors, then its metadata."""

from __future__ import annotations

from typing import TYPE_CHECKING

from maskln_cli.cli.report.consoles import plain_when_piped
from maskln_cli.cli.report.tables import print_simple_table
from maskln_cli.cli.report.text import number, plain_safe, safe
from maskln_cli.files.resources import human_bytes

if TYPE_CHECKING:
    from rich.text import Text

    from maskln_cli.jobs.inspect import FileSummary, TensorSummary


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
        if summary.norm is not None:
            console.print(_norm_line(summary), soft_wrap=True)
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


def _norm_line(summary: FileSummary) -> Text:
    """``norm  RMSNorm, eps 1e-06 (from model/config.json: rms_norm_eps)``."""
    from rich.text import Text

    from maskln_cli.op.norms import NORMS

    found = summary.norm
    assert found is not None
    eps = f", eps {found.eps!r}" if found.eps is not None else ""
    line = Text("norm", style="table.title")
    line.append(f"  {NORMS[found.name].title}{eps} (from {plain_safe(found.source)})")
    return line


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
