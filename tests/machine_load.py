"""The machine's load in the slow tests: tests that load it on purpose (CPU burners) take turns,
and tests whose measure such a load disturbs wait until none runs. One lock file for both,
as pytest-xdist's ``xdist_group`` marks are lost under pytest 9 (they rename the tests' node
ids, which pytest 9 no longer lets them do)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

LOAD_LOCK = Path(tempfile.gettempdir()) / f"maskln-loaded-machine-{os.getuid()}.lock"
"""Held alone while a test loads the machine: two tests' loads on two pytest workers stacked to
16 or more per core, where the grader's start-up took minutes and those tests failed (4 of 7,
when tests/grading/test_slow_correct_code.py ran on two workers); held shared while a test
measures what a load disturbs (glibc's heap growth in tests/verify/test_heap_kept.py)."""


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """The block loads the machine: it waits for every other holder of :data:`LOAD_LOCK`."""
    with open(LOAD_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        yield


@contextlib.contextmanager
def unloaded() -> Iterator[None]:
    """The block needs no test's load beside it (other measuring blocks may run)."""
    with open(LOAD_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        yield
