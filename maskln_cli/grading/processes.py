"""The processes a graded function starts, found and killed: every one of them, however deep and
however detached (Linux; elsewhere, the child's process group only).

The grader is a child subreaper while it grades (``PR_SET_CHILD_SUBREAPER``, with
``contain``): a process the function detaches (a double fork, ``setsid``) comes back to it when
its parent ends, instead of to init. :func:`kill_descendants` then kills the whole tree under
the grader at once, again and again until none is left: a chain of detached processes, each
killed level orphaning the next, is gone in a round or two, not one level per round.

The grader is also not dumpable while it grades (``PR_SET_DUMPABLE`` 0), so that a process of
the same user that is not root cannot open ``/proc/<grader>/fd`` (its stdout) or ptrace it; a
class grade's workers and their children are not dumpable for their whole life
(:func:`make_undumpable`), and children forked rather than started (:class:`Forked`) never are.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Iterator

GRACE_SECONDS = 1.0
"""Between SIGTERM and SIGKILL."""
KILL_DEADLINE = 10.0
"""How long :func:`kill_descendants` keeps killing a tree that keeps forking."""

# prctl(2) options (linux/prctl.h)
PR_SET_PDEATHSIG = 1
PR_GET_DUMPABLE = 3
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37


def prctl(option: int, value: int | ctypes.c_int = 0) -> int | None:
    """prctl(2) through libc; None when it failed or does not exist (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        argument = ctypes.byref(value) if isinstance(value, ctypes.c_int) else ctypes.c_ulong(value)
        result = int(
            libc.prctl(option, argument, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
        )
    except (OSError, AttributeError, TypeError):
        return None
    return None if result < 0 else result


@contextlib.contextmanager
def protected_grader(contain: bool = False) -> Iterator[None]:
    """While grading (Linux; elsewhere nothing): this process is not dumpable, so a process of
    the same user that is not root cannot open its /proc/<pid>/fd (write into its stdout) or
    ptrace it; with ``contain``, it is a child subreaper, so processes the function detaches
    come back to it to be killed (:func:`kill_descendants`; for a process that does nothing
    else, the command). Both are restored afterwards."""
    dumpable = prctl(PR_GET_DUMPABLE)
    if dumpable:
        prctl(PR_SET_DUMPABLE, 0)
    subreaper = None
    if contain:
        flag = ctypes.c_int(0)
        if prctl(PR_GET_CHILD_SUBREAPER, flag) is not None and not flag.value:
            subreaper = prctl(PR_SET_CHILD_SUBREAPER, 1)
    try:
        yield
    finally:
        if subreaper is not None:
            prctl(PR_SET_CHILD_SUBREAPER, 0)
        if dumpable:
            prctl(PR_SET_DUMPABLE, dumpable)


def make_undumpable() -> None:
    """This process not dumpable from now on (Linux): a process of the same user that is not
    root can no longer open its /proc/<pid>/fd, /proc/<pid>/mem or /proc/<pid>/environ, nor
    ptrace it. Kept across fork (a forked child is never dumpable), reset by exec."""
    prctl(PR_SET_DUMPABLE, 0)


def die_with_parent(parent: str | None) -> None:
    """In a child: SIGKILL it when its parent ends (killed by the function, say), rather than
    leave it running; if the parent (pid ``parent``) is gone already, end now."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and str(os.getppid()) != parent:
        os._exit(1)


def processes() -> list[tuple[int, int, int]]:
    """(pid, parent pid, session id) of every process this one can see in /proc (Linux;
    elsewhere none)."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as stat:
                    fields = stat.read().rpartition(b")")[2].split()
                found.append((int(entry), int(fields[1]), int(fields[3])))
            except (OSError, IndexError, ValueError):
                continue  # it ended meanwhile
    return found


def children() -> set[int]:
    """This process's children now."""
    me = os.getpid()
    return {pid for pid, ppid, _ in processes() if ppid == me}


def descendants(spare: Collection[int] = (), keep: Collection[int] = ()) -> list[int]:
    """Every process under this one (children, theirs, ...), but those under ``spare``
    (children this process had before the grade: not the function's) and those in ``keep``
    (not their own descendants)."""
    table = processes()
    under: dict[int, list[int]] = {}
    for pid, ppid, _ in table:
        under.setdefault(ppid, []).append(pid)
    found: list[int] = []
    frontier = [pid for pid in under.get(os.getpid(), []) if pid not in spare]
    while frontier:
        found += [pid for pid in frontier if pid not in keep]
        frontier = [child for pid in frontier for child in under.get(pid, [])]
    return found


def kill_group(process: subprocess.Popen[bytes] | Forked) -> None:
    """SIGTERM the child's process group, then SIGKILL after a grace period."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(GRACE_SECONDS)
        os.killpg(process.pid, signal.SIGKILL)  # what it started, too
    if process.poll() is None:  # not reaped: its pid is still its own
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(process.pid, signal.SIGKILL)  # a forked child before its own setsid
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(GRACE_SECONDS)


def kill_session(session: int) -> None:
    """SIGKILL what is left of the child's session (it is the session's leader: ``session`` is
    its pid): processes that left its process group with setpgid, not those that left the
    session with setsid (:func:`kill_descendants` finds those)."""
    for pid, _, sid in processes():
        if sid == session and pid != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def kill_descendants(
    spare: Collection[int] = (), deadline: float = KILL_DEADLINE, keep: Collection[int] = ()
) -> None:
    """SIGKILL every process under this one but those under ``spare`` and those in ``keep``,
    all at once, and reap those that are its children; repeat until none is left (or
    ``deadline`` seconds). As a child subreaper (:func:`protected_grader` with ``contain``),
    with the graded child stopped, they are the processes the function started: a detached one
    came back to this process when its parent ended, and one whose parent is killed here comes
    back at once."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        found = descendants(spare, keep)
        if not found:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        _reap({*spare, *keep})
        time.sleep(0.01)  # orphans of those killed are reparented here meanwhile


def _reap(spare: Collection[int]) -> None:
    """Collect this process's ended children (not ``spare``), without waiting for others."""
    for pid in children() - set(spare):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


class Forked:
    """A child made by ``os.fork()`` (no exec), with the part of ``subprocess.Popen``'s
    interface the grader uses: ``pid``, ``poll``, ``wait`` and ``returncode`` (negative: the
    signal that ended it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -signal.SIGKILL  # reaped elsewhere: it is gone
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode


class CpuWait:
    """How long a process has waited for a CPU since this was made: the longest such wait of
    any of its threads (Linux's ``/proc/PID/task/TID/schedstat``, its second figure: time spent
    runnable on a run queue, not running). On a loaded machine a call's wall time is mostly
    this wait; a call that sleeps or blocks (a hang that uses no CPU) never waits for one.
    0 where the kernel keeps no such figures."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = self._waits()

    def _waits(self) -> dict[str, int]:
        waits: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{self.pid}/task"):
                with (
                    contextlib.suppress(OSError, ValueError, IndexError),
                    open(f"/proc/{self.pid}/task/{tid}/schedstat") as stat,
                ):
                    waits[tid] = int(stat.read().split()[1])
        return waits

    def seconds(self) -> float:
        """The longest wait for a CPU of one thread since :meth:`__init__` (a thread started
        since counts all of its own)."""
        now = self._waits()
        longest = max((ns - self.start.get(tid, 0) for tid, ns in now.items()), default=0)
        return max(0, longest) / 1e9
