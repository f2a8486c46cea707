"""A fast path for rich's table layout, for the simple tables and grids the reports are made of:
rich's own output (tests/cli/test_tables.py holds it to that), without rich laying out each cell.

Whatever it does not know (a table that wraps, other boxes and styles) it leaves to rich.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.segment import Segment
    from rich.table import Table
    from rich.text import Text


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
        flush_segments(console, pending or [])
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
    if 0 in padded:
        return False  # rich makes a column of no width at all 1 wide: let it
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


def flush_segments(console: Console, pending: list[Segment]) -> None:
    """Print ``pending`` (segments ending in a new line) at once, and empty it."""
    if pending:
        from rich.segment import Segments

        console.print(Segments(pending), soft_wrap=True)
        pending.clear()
