"""Work in blocks on worker threads, each running torch on one thread of its own.

torch runs each op on its OpenMP threads, forking and joining them per op. A block of rows
takes the op about twenty ops, so twenty joins, each waiting until every thread has been
scheduled: on 2 cores kept busy by another process, the forward of a 64 MiB x took 2 to 12
times the torch one-liner's time that way. Whole blocks on separate threads, each running its
ops serially, wait once per call (0.9 to 1.1 times the one-liner on the same busy machine).

``torch.set_num_threads`` cannot give a worker one thread: ATen keeps one process-wide count,
which every thread copies once, the first time it runs a parallel op, so a thread of the user's
that started in the meantime would keep one thread for its whole life. OpenMP's own count is
per thread (its ``nthreads-var``), and it is what ATen's parallel regions and
``torch.get_num_threads()`` read: :func:`one_thread` sets only that, for the calling thread.
Where torch is not built with OpenMP, nothing is changed and blocks run in the caller's thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_local = threading.local()
"""``in_worker``: the thread is one of the pool's (a nested call runs inline)."""
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


@functools.cache
def _openmp() -> tuple[Callable[[int], None], Callable[[], int]] | None:
    """``(omp_set_num_threads, omp_get_max_threads)`` of the OpenMP runtime torch runs on, or
    None when torch's parallel backend is not OpenMP or its symbols cannot be found."""
    import torch

    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        process = ctypes.CDLL(None)  # torch has loaded its OpenMP runtime into the process
        set_threads, max_threads = process.omp_set_num_threads, process.omp_get_max_threads
    except (OSError, AttributeError):
        return None
    set_threads.argtypes, set_threads.restype = [ctypes.c_int], None
    max_threads.argtypes, max_threads.restype = [], ctypes.c_int
    return set_threads, max_threads


@contextlib.contextmanager
def one_thread() -> Iterator[bool]:
    """torch on one thread in the calling thread, and only there; yields whether it is.

    Example:
        >>> import torch
        >>> before = torch.get_num_threads()
        >>> with one_thread() as single:
        ...     inside = torch.get_num_threads()
        >>> single, inside, torch.get_num_threads() == before
        (True, 1, True)
    """
    import torch

    openmp = _openmp()
    before = torch.get_num_threads()  # also ATen's lazy per-thread set-up, which would undo ours
    if openmp is None or before == 1:
        yield before == 1
        return
    set_threads, max_threads = openmp
    saved = max_threads()
    set_threads(1)
    try:
        yield torch.get_num_threads() == 1
    finally:
        set_threads(saved)


def _start_worker() -> None:
    import torch

    _local.in_worker = True
    openmp = _openmp()
    torch.get_num_threads()  # ATen's lazy per-thread set-up first: it would undo ours
    if openmp is not None:
        openmp[0](1)


def _executor(size: int) -> ThreadPoolExecutor:
    """The shared pool, of ``size`` workers (made again when the size asked for changes)."""
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != size:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(size, "maskln-block", initializer=_start_worker)
            _pool_size = size
        return _pool


def _forget_pool() -> None:
    """In a forked child the pool's threads do not exist: the next call makes a new pool."""
    global _pool, _pool_size, _lock
    _pool, _pool_size, _lock = None, 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def workers() -> int:
    """How many blocks :func:`map_blocks` runs at once from the calling thread: torch's thread
    count there, or 1 inside a worker or where threads cannot be given one torch thread each.

    Example:
        >>> workers() >= 1
        True
    """
    import torch

    if getattr(_local, "in_worker", False) or _openmp() is None:
        return 1
    return torch.get_num_threads()


def map_blocks(work: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[work(item) for item in items]``, in order, each on one torch thread.

    The items run on :func:`workers` threads of a shared pool (torch releases the GIL inside
    its ops), under the caller's grad and inference modes, or in the calling thread when there
    is one item or one worker. Results never
    depend on which: every op runs serially. An exception is raised once every item has
    finished or failed, so no work goes on after the call.

    Example:
        >>> map_blocks(lambda n: n * n, [1, 2, 3])
        [1, 4, 9]
    """
    import torch

    size = workers()
    if size <= 1 or len(items) <= 1:
        with one_thread():
            return [work(item) for item in items]
    # Grad and inference mode are per thread: the workers take the caller's.
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def run(item: T) -> R:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return work(item)

    pool = _executor(size)
    futures = [pool.submit(run, item) for item in items]
    wait(futures)
    return [future.result() for future in futures]
