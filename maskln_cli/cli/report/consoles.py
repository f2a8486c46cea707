"""The two consoles, stdout's and stderr's, and output made plain when stdout is no terminal.

The consoles replace no ``:name:`` emoji codes and highlight nothing. Other modules call them as
``consoles.stdout_console()`` and ``consoles.stderr_console()``, looked up here at each call, so
that a test swaps a console in this one place.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console


PIPED_WIDTH = 1 << 20
"""The width of stdout off a terminal: wider than any row, so that rich never shrinks a table's
columns (at 400 columns a 380-character key cut every other field of its row away), and nothing
is wrapped. Tables are as wide as their cells; cells' padding is stripped at line ends."""


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
    width = None if sys.stdout.isatty() else PIPED_WIDTH
    return StdoutConsole(highlight=False, soft_wrap=False, width=width, emoji=False)


@functools.cache
def stderr_console() -> Console:
    from rich.console import Console

    return Console(stderr=True, highlight=False, emoji=False)


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
    with closed_pipe_ends_quietly():
        console.file.write(text)
        console.file.flush()


@contextlib.contextmanager
def closed_pipe_ends_quietly() -> Iterator[None]:
    """A write to a closed stdout raises StdoutClosed, on which a command ends quietly."""
    from maskln_cli.errors import StdoutClosed

    try:
        yield
    except BrokenPipeError:
        raise StdoutClosed from None
