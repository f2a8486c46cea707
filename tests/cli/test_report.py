"""What people read: progress bars, escaping, JSON formatting."""

from __future__ import annotations

import io
import json

from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

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
