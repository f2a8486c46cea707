"""The fast path for rich's table layout (:mod:`maskln_cli.cli.report.tables`) prints what rich
prints: the same bytes on a console without colour (a pipe, a file: what people diff), the same
characters in the same styles on a terminal (rich splits its style codes differently); and where
rich would wrap a cell, it prints nothing and leaves the table to rich."""

from __future__ import annotations

import random

from rich import box
from rich.console import Console
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from maskln_cli.cli.report import tables
from maskln_cli.cli.report.text import plain_safe, safe


def make(kind: str, title: str | None) -> Table:
    """A table as the reports make them: a grid (a tensor's block in verify and diff) or a
    SIMPLE_HEAD table with a header and maybe a title (inspect's, a worst-rows table)."""
    if kind == "grid":
        made = Table.grid(padding=(0, 2))
        made.add_column(style="bold", no_wrap=True)
        made.add_column()
        return made
    made = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left")
    made.add_column("key", style="bold", no_wrap=True)
    made.add_column("size", justify="right", no_wrap=True)
    made.add_column("values")
    return made


def styled_characters(text: str) -> list[tuple[str, str]]:
    """Each character printed, with the styles it is printed in."""
    parsed = Text.from_ansi(text)
    styles = [""] * len(parsed.plain)
    for span in parsed.spans:
        for i in range(span.start, span.end):
            styles[i] += f"{span.style};"
    return list(zip(parsed.plain, styles, strict=True))


def print_both(kind: str, title: str | None, rows: list[list[str]], width: int, colours):
    """What rich prints for a table holding ``rows``, and what the fast path prints (None when
    it declined: inspect's print_simple_table must then have printed nothing, print_table rich's
    own table). ``given`` tables are filled as inspect fills them: plain cells but the last, a
    Text of markup."""
    fast, slow = (Console(width=width, force_terminal=True, color_system=colours) for _ in "ab")
    reference = make(kind, title)
    for row in rows:
        given = [Text(c) for c in row[:-1]] + [Text.from_markup(row[-1])]
        reference.add_row(*(given if kind == "given" else row))
    with slow.capture() as slow_output:
        slow.print(reference)
    with fast.capture() as fast_output:
        if kind == "given":
            given = [[*row[:-1], Text.from_markup(row[-1])] for row in rows]
            done = tables.print_simple_table(fast, make(kind, title), given)
        else:  # as the comparison report prints tables: segments gathered, printed at once
            pending: list[Segment] = []
            tables.print_table(fast, reference, pending)
            done = bool(pending)  # else rich printed the table itself
            tables.flush_segments(fast, pending)
    if not done:
        assert fast_output.get() == ("" if kind == "given" else slow_output.get())
        return slow_output.get(), None
    return slow_output.get(), fast_output.get()


def test_simple_tables_and_grids_print_as_rich_prints_them():
    """print_simple_table and print_table are fast paths of rich's own table layout: same
    characters, same styles, for cells with wide, combining and markup characters and
    trailing spaces, in tables with a header and a title, and in grids."""
    generator = random.Random(0)
    alphabet = "ab[]:.\\ é∑\u0301💥中"

    def text() -> str:
        return "".join(generator.choice(alphabet) for _ in range(generator.randint(0, 12)))

    printed = {"table": 0, "grid": 0, "given": 0}
    for trial in range(450):
        kind = ("table", "grid", "given")[trial % 3]
        columns = 2 if kind == "grid" else 3
        rows = []
        for _ in range(generator.randint(0, 4)):
            markup = generator.choice(["min=1  max=2", "[red]NaN=3[/]  ", "[bold red]FAIL[/] x"])
            rows.append([*(text() for _ in range(columns - 1)), markup])
        title = generator.choice([None, "worst rows of " + text()])
        width = generator.choice([30, 60, 120])
        for colours in (None, "truecolor"):
            slow, fast = print_both(kind, title, rows, width, colours)
            if fast is None:  # too wide: rich wraps it
                continue
            printed[kind] += 1
            assert styled_characters(fast) == styled_characters(slow)
            if colours is None:
                assert fast == slow
    assert min(printed.values()) > 100


CONTROL = ["\x1b[2J", "\x07", "\x00", "\t", "\n", "\r", "\x7f", "\x9b"]
FORMAT = ["\u202e", "\u200b", "\u2028", "\ufeff", "\u00ad"]  # and separators
MARKUP = ["[bold red]x[/]", "[/]", "[", "]", "\\", "\\[b]", "a\\", "[link=x]y", ":warning:", ":x:"]
WIDE = ["中文", "💥", "e\u0301", "\uff21\uff22", "한국어", "\U0001f468\u200d\U0001f469", "k" * 70]
HOSTILE = [*CONTROL, *FORMAT, *MARKUP, *WIDE, "enc:warning:w", " ", "  ", "a"]


def test_hostile_and_wide_cells_print_as_rich_prints_them():
    """Cells as the reports make them of what a file holds (a key through plain_safe in a Text
    cell, through safe in markup): control and format characters, markup, backslashes, emoji
    codes, wide and combining characters, keys as wide as the console or wider. The fast path
    prints rich's bytes, or leaves the table to rich where rich would wrap it."""
    generator = random.Random(1)

    def raw() -> str:
        return "".join(generator.choice(HOSTILE) for _ in range(generator.randint(0, 4)))

    counts = {(kind, way): 0 for kind in ("table", "grid", "given") for way in ("fast", "rich")}
    for trial in range(300):
        kind = ("table", "grid", "given")[trial % 3]
        rows = []
        for _ in range(generator.randint(0, 4)):
            if kind == "given":  # inspect: a key and plain cells, then markup
                rows.append([plain_safe(raw()), plain_safe(raw()), f"[red]{safe(raw())}[/]"])
            elif kind == "grid":  # a tensor's block: "PASS name", then a value
                rows.append([f"[bold green]PASS[/] {safe(raw())}", safe(raw())])
            else:  # a worst-rows table
                rows.append([safe(raw()), safe(raw()), f"[red]{safe(raw())}[/]"])
        title = generator.choice([None, f"worst rows of {safe(raw())}"])
        width = generator.choice([20, 40, 80, 100, 200])
        for colours in (None, "truecolor"):
            slow, fast = print_both(kind, title, rows, width, colours)
            counts[kind, "rich" if fast is None else "fast"] += 1
            if fast is None:
                continue
            assert styled_characters(fast) == styled_characters(slow)
            if colours is None:
                assert fast == slow
    assert min(counts.values()) > 50, counts  # each kind, both ways


def test_a_column_rich_would_widen_is_left_to_rich():
    """rich makes a column with no width at all (a grid's last, every cell empty) 1 wide: the
    fast path, which would make it 0, declines, and print_table leaves the table to rich."""
    console = Console(width=80, force_terminal=True, color_system=None)
    with console.capture() as declined:
        assert not tables.print_simple_table(console, make("grid", None), [["PASS out", ""]])
    assert declined.get() == ""
    slow, fast = print_both("grid", None, [["[bold green]PASS[/] out", ""]], 80, None)
    assert fast is None and slow == "PASS out   \n"  # print_table printed rich's own
