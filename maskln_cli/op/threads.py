"""Work in blocks on worker threads, each running torch on one thread of its own, and torch
on one thread in one thread of the program, never in the others.

torch runs each op on its OpenMP threads, forking and joining them per op. A block of rows
takes the op about twenty ops, so twenty joins, each waiting until every thread has been
scheduled: on 2 cores kept busy by another process, the forward of a 64 MiB x took 2 to 12
times the torch one-liner's time that way. Whole blocks on separate threads, each running its
ops serially, wait once per call (0.4 to 1.1 times the one-liner on the same busy machine).

``torch.set_num_threads`` cannot give a worker one thread: it is process-wide. ATen keeps one
count, and every thread that first runs a parallel op while it is 1 stays on one thread for its
life (each thread's OpenMP thread count is set from that count once, lazily). A library must
not do that to its caller's threads. With the OpenMP backend torch reads each thread's own
count (``omp_get_max_threads``), so ``omp_set_num_threads`` from the OpenMP runtime torch
loaded changes the calling thread alone; :func:`_thread_setter` finds it and checks it does
just that. Without it (another backend, no runtime found, the check failing) nothing is
changed and blocks run in the calling thread: slower, never wrong.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")
OPENMP_NAMES = ("libgomp", "libomp", "libiomp")
"""OpenMP runtimes as torch's builds ship them (GNU on Linux, LLVM on macOS, Intel's)."""

_local = threading.local()
"""``in_worker``: the thread is one of the pool's (a nested call runs inline)."""
_lock = threading.Lock()


def _loaded_openmp() -> list[str]:
    """Paths of the OpenMP runtimes this process may have loaded, torch's own first."""
    import torch

    candidates: list[str] = []
    # Linux: what is mapped (the path is a line's sixth field); elsewhere torch's folders.
    # Mapped files' names are bytes (a data file's may not be UTF-8): decoded as os does.
    with contextlib.suppress(OSError), open("/proc/self/maps", errors="surrogateescape") as maps:
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
    with _setter_lock:  # pool workers starting together check once (reentrant: a signal
        # handler calling the op during the check would wait for itself)
        return _check_thread_setter()


_setter_lock = threading.RLock()


def _check_thread_setter() -> Callable[[int], None] | None:
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


def _start_worker() -> None:
    import torch

    _local.in_worker = True
    torch.get_num_threads()  # ATen's lazy per-thread set-up first: it would undo ours
    setter = _thread_setter()
    if setter is not None:
        setter(1)


def _executor(size: int) -> ThreadPoolExecutor:
    """The shared pool of ``size`` workers. Pools are kept, one per size: threads of the program
    with different torch thread counts may call at once, and a pool shut down under another
    caller would refuse its work."""
    with _lock:
        pool = _pools.get(size)
        if pool is None:
            pool = _pools[size] = ThreadPoolExecutor(
                size, "maskln-block", initializer=_start_worker
            )
        return pool


_pools: dict[int, ThreadPoolExecutor] = {}


def _forget_pools() -> None:
    """In a forked child the pools' threads do not exist: the next call makes new pools."""
    global _lock
    _pools.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def workers() -> int:
    """How many blocks :func:`map_blocks` runs at once from the calling thread: torch's thread
    count there, or 1 inside a worker, where threads cannot be given one torch thread each, and
    under a profiler or a torch function or dispatch mode (they are per thread: work on another
    thread would escape them).

    Example:
        >>> workers() >= 1
        True
    """
    import torch

    threads = torch.get_num_threads()
    if (
        threads == 1
        or getattr(_local, "in_worker", False)
        or torch._C._len_torch_dispatch_stack()
        or torch._C._len_torch_function_stack()
        or torch._C._autograd._profiler_enabled()
        or _thread_setter() is None
    ):
        return 1
    return threads


def map_blocks(work: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[work(item) for item in items]``, in order, each on one torch thread.

    The items run on :func:`workers` threads of a shared pool (torch releases the GIL inside
    its ops), under the caller's grad and inference modes, or in the calling thread when there
    is one item or one worker, or when the pool no longer takes work (the interpreter is
    shutting down). Results never depend on which: every op runs serially. An error is raised
    once every item has finished or failed; on an interruption (Ctrl-C), items not yet started
    are cancelled and those running are waited for, so no work goes on after the call.

    Example:
        >>> map_blocks(lambda n: n * n, [1, 2, 3])
        [1, 4, 9]
    """
    return Blocks(work, items).results()


class Blocks(Generic[R]):
    """:func:`map_blocks` started: the items are queued on the pool, and the caller goes on
    (verify merges one group's figures while the next group's blocks are measured) until it
    asks for :meth:`results`, or gives up with :meth:`cancel` (which it must, on an error of
    its own, so that no work goes on after it). Items the pool does not take (one worker, one
    item, a pool that no longer takes work) run in the calling thread when the results are
    asked: in the order a plain loop would run them."""

    def __init__(self, work: Callable[[T], R], items: Sequence[T]) -> None:
        import torch

        self._work = work
        self._futures: list[Future[R]] = []
        self._here: Sequence[T] = items  # the items left to the calling thread
        size = workers()
        if size <= 1 or len(items) <= 1:
            return
        # Grad and inference mode are per thread: the workers take the caller's.
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        def run(item: T) -> R:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                return work(item)

        try:
            pool = _executor(size)
            for item in items:
                self._futures.append(pool.submit(run, item))
        except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
            pass
        except BaseException:
            self.cancel()
            raise
        self._here = items[len(self._futures) :]

    def results(self) -> list[R]:
        """The results, in order, once every item has finished (the first error raised then;
        on an interruption, :meth:`cancel`)."""
        try:
            with one_thread():
                done_here = [self._work(item) for item in self._here]
            wait(self._futures)
        except BaseException:
            self.cancel()
            raise
        return [future.result() for future in self._futures] + done_here

    def cancel(self) -> None:
        """Items not started never run; those running are waited for."""
        for future in self._futures:
            future.cancel()
        wait(self._futures)
