"""The progress bar: on stderr, on a terminal only, once work has taken a moment."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from maskln_cli.cli.report import consoles
from maskln_cli.cli.report.text import plain_safe

if TYPE_CHECKING:
    from maskln_cli.files.problem import Progress


PROGRESS_DELAY = 0.5
"""Seconds of work before a progress bar appears (on a terminal only)."""


@contextlib.contextmanager
def progress_bar(description: str, enabled: bool = True) -> Iterator[Progress]:
    """A progress callback; a rich bar appears on stderr once the work has taken a moment.

    Nothing is drawn when stderr is not a terminal (pipelines and logs stay clean), nor when
    ``enabled`` is False (``--quiet``).
    """
    console = consoles.stderr_console()
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
