"""Inputs that shrink while they are read: one line and exit 2, not a silent SIGBUS.

Inputs are memory-mapped. When another process truncates a file while maskln reads it (a
producer saving it again in place: an everyday race), touching a page past the new end raises
SIGBUS, which by default kills the process with no message (exit 135), and which Python cannot
catch: its own handlers run between bytecodes, and a fault inside C code would repeat forever.

:func:`install_handler` puts a C-level handler in place (through ctypes). It names the input
that shrank (every file open for reading is registered with its size, by
:func:`watch`), removes the hidden ``.partial`` files of outputs being written under a name (on
filesystems without anonymous files: see :func:`maskln_cli.files.output.open_output`), and
ends the process at once with exit 2. Installing a process-wide handler is the application's
decision: the command line does it; the library only keeps the registry.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator

EXIT_CODE = 2

_watched: dict[int, tuple[str, int, int]] = {}
"""Inputs open for reading, by a key of their own: (name, size when opened, descriptor)."""
_keys = itertools.count()
_partials: set[str] = set()
_writing: list[int] = [0]
"""How many outputs are being written (anonymous or named): the message says they were not."""
_lock = threading.Lock()
_installed: list[object] = []
"""The ctypes handler, kept alive for the life of the process once installed."""
_ending = threading.Lock()
"""Taken by the first thread to fault: several threads reading the same mapping fault together,
and each would print the message (``os.write`` lets the others run) before ``_exit``."""


@contextlib.contextmanager
def watch(name: str, fd: int) -> Iterator[None]:
    """Register the open input ``fd`` (named ``name`` in messages) for as long as it is read."""
    size = os.fstat(fd).st_size
    with _lock:
        key = next(_keys)
        _watched[key] = (name, size, fd)
    try:
        yield
    finally:
        with _lock:
            _watched.pop(key, None)


@contextlib.contextmanager
def writing() -> Iterator[None]:
    """An output is being written for as long as this lasts."""
    with _lock:
        _writing[0] += 1
    try:
        yield
    finally:
        with _lock:
            _writing[0] -= 1


def add_partial(path: str) -> None:
    """A named temporary output now exists (or is about to): remove it if SIGBUS ends us."""
    with _lock:
        _partials.add(path)


def discard_partial(path: str) -> None:
    with _lock:
        _partials.discard(path)


def shrunk() -> list[str]:
    """The names of watched inputs that are now shorter than when they were opened."""
    found = []
    for name, size, fd in list(_watched.values()):
        try:
            now = os.fstat(fd).st_size
        except OSError:
            continue
        if now < size:
            found.append(name)
    return found


def _on_sigbus(signum: int) -> None:
    """Runs inside the signal handler: plain system calls only, then ``_exit``."""
    if not _ending.acquire(blocking=False):
        while True:  # another thread is already reporting and ending the process
            time.sleep(1)
    try:
        names = shrunk()
        if names:
            what = f"{names[0]}: the file shrank while it was being read"
        else:
            what = "an input file changed while it was being read (SIGBUS)"
        if _writing[0]:
            what += "; the output was not written"
        message = f"maskln: error: {what}\n"
        os.write(2, message.encode("utf-8", "replace"))
        for path in list(_partials):
            with contextlib.suppress(OSError):
                os.unlink(path)
    finally:
        os._exit(EXIT_CODE)


def install_handler() -> bool:
    """Handle SIGBUS as above, for the rest of the process; False where that is not possible
    (no SIGBUS, or no C library to install a handler through)."""
    if _installed:
        return True
    number = getattr(signal, "SIGBUS", None)
    if number is None:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)
        handler = handler_type(_on_sigbus)
        install = libc.signal
        install.restype = ctypes.c_void_p
        install.argtypes = [ctypes.c_int, handler_type]
    except (OSError, AttributeError):
        return False
    if install(int(number), handler) == ctypes.c_void_p(-1).value:  # SIG_ERR
        return False
    _installed.append(handler)
    return True
