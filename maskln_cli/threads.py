"""torch on one thread in one thread of the program, never in the others.

``torch.set_num_threads`` is process-wide: ATen keeps one count, and every thread that first
runs a parallel op while it is 1 stays on one thread for its life (each thread's OpenMP thread
count is set from that count once, lazily). A library must not do that to its caller's threads.
With the OpenMP backend torch reads each thread's own count (``omp_get_max_threads``), so
``omp_set_num_threads`` from the OpenMP runtime torch loaded changes the calling thread alone;
:func:`_thread_setter` finds it and checks it does just that. Without it (another backend, no
runtime found, the check failing) nothing is changed: slower on tiny tensors, never wrong.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")
OPENMP_NAMES = ("libgomp", "libomp", "libiomp")
"""OpenMP runtimes as torch's builds ship them (GNU on Linux, LLVM on macOS, Intel's)."""


def _loaded_openmp() -> list[str]:
    """Paths of the OpenMP runtimes this process may have loaded, torch's own first."""
    import torch

    candidates: list[str] = []
    # Linux: what is mapped (the path is a line's sixth field); elsewhere torch's folders.
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6 and any(n in Path(fields[5]).name for n in OPENMP_NAMES):
                candidates.append(fields[5].strip())
    root = Path(torch.__file__).parent
    for folder in (root / "lib", root.parent / "torch.libs", root / ".dylibs"):
        with contextlib.suppress(OSError):
            candidates += [
                str(path)
                for path in sorted(folder.iterdir())
                if any(path.name.startswith(name) for name in OPENMP_NAMES)
            ]
    unique = list(dict.fromkeys(candidates))
    return sorted(unique, key=lambda path: not path.startswith(str(root.parent)))


_CHECKED: list[Callable[[int], None] | None] = []
"""The outcome of :func:`_thread_setter`'s check, once made."""


def _thread_setter() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the runtime torch uses, when it is checked to change the
    thread count torch reports in the calling thread only; None otherwise."""
    if _CHECKED:
        return _CHECKED[0]
    import torch

    if sys.platform == "win32" or "OpenMP" not in torch.__config__.parallel_info():
        _CHECKED.append(None)
        return None
    for path in _loaded_openmp():
        try:  # RTLD_NOLOAD: only a runtime already loaded, never a second copy
            runtime = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            setter = runtime.omp_set_num_threads
        except (OSError, AttributeError):
            continue
        setter.argtypes, setter.restype = [ctypes.c_int], None
        outcome = _changes_one_thread(setter)
        if outcome is None:  # torch on 1 thread: nothing to tell; checked when it matters
            return None
        if outcome:
            _CHECKED.append(setter)
            return setter
    _CHECKED.append(None)
    return None


def _changes_one_thread(setter: Callable[[int], None]) -> bool | None:
    """Whether ``setter(1)`` in a new thread makes torch there report 1 thread and leaves the
    count of this thread, and of threads started later, as they were; None when torch is on
    one thread anyway, so that nothing tells a working setter from one that does nothing."""
    import torch

    mine = torch.get_num_threads()
    seen: list[int] = []

    def probe(set_first: bool) -> None:
        torch.get_num_threads()  # ATen's lazy per-thread setup first, or it undoes ours
        if set_first:
            setter(1)
        seen.append(torch.get_num_threads())

    for set_first in (False, True, False):
        thread = threading.Thread(target=probe, args=(set_first,))
        thread.start()
        thread.join()
    if seen[0] == 1:
        return None
    return seen == [seen[0], 1, seen[0]] and torch.get_num_threads() == mine


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread in the calling thread for the block, then as it was; the count
    other threads have, or start with, is untouched.

    Example:
        >>> import torch
        >>> before = torch.get_num_threads()
        >>> with one_thread():
        ...     inside = torch.get_num_threads()
        >>> inside == 1 or _thread_setter() is None, torch.get_num_threads() == before
        (True, True)
    """
    import torch

    threads = torch.get_num_threads()  # also ATen's lazy setup of this thread, done first
    setter = _thread_setter() if threads > 1 else None
    if setter is None:
        yield
        return
    setter(1)
    try:
        yield
    finally:
        setter(threads)


def map_one_thread_workers(work: Callable[[T], R], items: Sequence[T], threads: int) -> list[R]:
    """``[work(item) for item in items]`` in order, on ``threads`` worker threads each running
    torch on one thread; in the calling thread when that cannot be arranged (two workers each
    forking torch's threads on every op would fight over the cores).

    Example:
        >>> map_one_thread_workers(lambda n: n * n, [1, 2, 3], 2)
        [1, 4, 9]
    """
    import torch

    setter = _thread_setter() if threads > 1 else None
    if setter is None:
        return [work(item) for item in items]

    def start() -> None:
        torch.get_num_threads()  # ATen's lazy per-thread setup first, or it undoes ours
        setter(1)

    with ThreadPoolExecutor(threads, initializer=start) as pool:
        return list(pool.map(work, items))
