"""What people read: progress bars, escaping, JSON formatting."""

from __future__ import annotations

import io
import json

from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from maskln_cli.cli.report import tables
from maskln_cli.cli.report.json_output import to_json
from maskln_cli.cli.report.progress import progress_bar
from maskln_cli.cli.report.text import safe


def test_progress_bar_appears_on_a_terminal_once_work_takes_a_moment(monkeypatch):
    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=80)
    monkeypatch.setattr("maskln_cli.cli.report.consoles.stderr_console", lambda: terminal)
    monkeypatch.setattr("maskln_cli.cli.report.progress.PROGRESS_DELAY", 0.0)
    with progress_bar("normalize big.safetensors") as progress:
        progress(25, 100)
        progress(50, 100)
    drawn = screen.getvalue()
    assert "normalize big.safetensors" in drawn and "50%" in drawn


def test_no_progress_bar_for_quick_work_or_off_a_terminal(monkeypatch):
    for console, delay in (
        (Console(file=io.StringIO(), force_terminal=True), 60.0),  # quick: under the delay
        (Console(file=io.StringIO(), force_terminal=False), 0.0),  # a pipe or a log file
    ):
        monkeypatch.setattr(
            "maskln_cli.cli.report.consoles.stderr_console", lambda console=console: console
        )
        monkeypatch.setattr("maskln_cli.cli.report.progress.PROGRESS_DELAY", delay)
        with progress_bar("job") as progress:
            progress(1, 2)
        assert console.file.getvalue() == ""


def test_json_has_no_nan_or_infinity():
    text = to_json({"a": float("nan"), "b": [float("inf"), 1.5], "c": {"d": -float("inf")}})
    assert json.loads(text) == {"a": None, "b": [None, 1.5], "c": {"d": None}}
    assert "NaN" not in text and "Infinity" not in text


def test_safe_escapes_control_and_format_characters():
    shown = safe("a\x1b[31mb\x07c\u202ed\u2028e[bold]")
    for raw in ("\x1b", "\x07", "\u202e", "\u2028"):
        assert raw not in shown
    assert "\\x1b" in shown and "\\u202e" in shown and "\\[bold]" in shown


def test_simple_tables_and_grids_print_as_rich_prints_them():
    """print_simple_table and print_table are fast paths of rich's own table layout: same
    characters, same styles, for cells with wide, combining and markup characters and
    trailing spaces, in tables with a header and a title, and in grids."""
    import random

    from rich import box
    from rich.table import Table
    from rich.text import Text

    def make(kind: str, title: str | None) -> Table:
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
        parsed = Text.from_ansi(text)
        styles = [""] * len(parsed.plain)
        for span in parsed.spans:
            for i in range(span.start, span.end):
                styles[i] += f"{span.style};"
        return list(zip(parsed.plain, styles, strict=True))

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
        for options in ({"color_system": None}, {"color_system": "truecolor"}):
            fast, slow = (Console(width=width, force_terminal=True, **options) for _ in "ab")
            reference = make(kind, title)
            for row in rows:  # inspect's cells are plain text but the last, Text
                given = [Text(c) for c in row[:-1]] + [Text.from_markup(row[-1])]
                reference.add_row(*(given if kind == "given" else row))
            with slow.capture() as slow_output:
                slow.print(reference)
            with fast.capture() as fast_output:
                if kind == "given":  # as inspect gives them
                    given = [[*row[:-1], Text.from_markup(row[-1])] for row in rows]
                    done = tables.print_simple_table(fast, make(kind, title), given)
                else:
                    tables.print_table(fast, reference)
                    done = True
            if not done:  # too wide: rich wraps it
                assert fast_output.get() == ""
                continue
            printed[kind] += 1
            assert styled_characters(fast_output.get()) == styled_characters(slow_output.get())
            if options["color_system"] is None:
                assert fast_output.get() == slow_output.get()
    assert min(printed.values()) > 100


def test_to_json_encodes_as_the_json_module_does():
    """Every scalar as json.dumps writes it (strings escaped to ASCII, floats by repr); the
    layout is json.dumps(indent=2)'s but for lists of numbers, on one line."""
    document = {
        "text": 'k[ 1,  2 ] "q" \\ é 💥 \u2028 \x00',
        "numbers": [1, -2.5e-300, 1e300, 2**70, None, float("nan")],
        "flags": [True, False],
        "nested": [{"a": []}, {}, [[1, 2], [3]], ("t", 1)],
        7: 0.1,
    }
    text = to_json(document)
    assert '"numbers": [1, -2.5e-300, 1e+300, 1180591620717411303424, null, null]' in text
    assert json.loads(text) == json.loads(
        json.dumps({**document, "numbers": [*document["numbers"][:5], None]})
    )
    without_number_lists = {k: v for k, v in document.items() if k not in ("numbers", "nested")}
    assert to_json(without_number_lists) == json.dumps(without_number_lists, indent=2)


@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(st.sampled_from(["\\", "[", "]", "/", "a", "b", "#", "@", " ", ":x:", "é"])).map(
        "".join
    ),
    context=st.sampled_from([("", ""), ("[bold]", "[/]"), ("x ", " ([red]y[/])"), ("", " z]")]),
)
def test_safe_markup_shows_any_text_as_it_is(text, context):
    """Markup made by safe() renders as the text itself, whatever comes before and after:
    backslashes before brackets and at the end included (rich's own escape gets both
    wrong)."""
    from rich.markup import render

    before, after = context
    shown = render(before + safe(text) + after, emoji=False).plain
    assert shown == render(before + "Q" + after, emoji=False).plain.replace("Q", text)
