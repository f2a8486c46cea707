"""What people read: progress bars, escaping, JSON formatting."""

from __future__ import annotations

import io
import json

from rich.console import Console

from maskln_cli import report


def test_progress_bar_appears_on_a_terminal_once_work_takes_a_moment(monkeypatch):
    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=80)
    monkeypatch.setattr(report, "stderr_console", lambda: terminal)
    monkeypatch.setattr(report, "PROGRESS_DELAY", 0.0)
    with report.progress_bar("normalize big.safetensors") as progress:
        progress(25, 100)
        progress(50, 100)
    drawn = screen.getvalue()
    assert "normalize big.safetensors" in drawn and "50%" in drawn


def test_no_progress_bar_for_quick_work_or_off_a_terminal(monkeypatch):
    for console, delay in (
        (Console(file=io.StringIO(), force_terminal=True), 60.0),  # quick: under the delay
        (Console(file=io.StringIO(), force_terminal=False), 0.0),  # a pipe or a log file
    ):
        monkeypatch.setattr(report, "stderr_console", lambda console=console: console)
        monkeypatch.setattr(report, "PROGRESS_DELAY", delay)
        with report.progress_bar("job") as progress:
            progress(1, 2)
        assert console.file.getvalue() == ""


def test_json_has_no_nan_or_infinity():
    text = report.to_json({"a": float("nan"), "b": [float("inf"), 1.5], "c": {"d": -float("inf")}})
    assert json.loads(text) == {"a": None, "b": [None, 1.5], "c": {"d": None}}
    assert "NaN" not in text and "Infinity" not in text


def test_safe_escapes_control_and_format_characters():
    shown = report.safe("a\x1b[31mb\x07c\u202ed\u2028e[bold]")
    for raw in ("\x1b", "\x07", "\u202e", "\u2028"):
        assert raw not in shown
    assert "\\x1b" in shown and "\\u202e" in shown and "\\[bold]" in shown
