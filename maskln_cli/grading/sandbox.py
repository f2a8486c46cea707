"""The child process of ``maskln grade``: the graded function runs there, never in the grader.

The parent (:class:`Sandbox`) starts a child (:mod:`.child`) once, has it import the target,
then asks it to run one clause at a time. The child builds the clause's cases from the seed (the
same code the parent uses), calls the function and sends back what it computed: tensors as
safetensors bytes and facts as JSON (never pickle), which the parent judges against cases it
built itself. So a function that patches torch in its own process cannot change a verdict on
values. A crash or a hang costs the clause it happened in: the parent kills the child (SIGTERM,
then SIGKILL after a grace period), and starts a new one for the next clause; after
:data:`GIVE_UP_AFTER` such failures in a row, the remaining clauses are not run.

``maskln grade TARGET`` starts its child (``python -I``: it imports torch and the grader itself);
a class grade's worker forks it (``fork``: torch and the grader are imported already, nothing is
read from disk again, and the child is never dumpable, not even while it starts).

Protocol, over one Unix socket the parent creates (``/proc/<pid>/fd`` cannot open a socket, so
no other process can write into it):

- parent -> child: one JSON object per line, ``{"op": "load", "target": ...}`` first, then
  ``{"op": "run", "clause": ..., "seed": ..., "per_call": ...}``;
- child -> parent: frames of a 16-byte header (JSON length, data length: big-endian u64),
  the JSON (``{"ready": ...}`` once torch and the grader are imported, before the load;
  ``{"ok": ...}`` for a load; ``{"at": ...}`` before each call, naming its case;
  ``{"tick": seconds}`` before each call, with ``per_call``: how long it may take;
  ``{"meta", "errors", "failure"}`` for a run), then the data (safetensors bytes, possibly
  empty).

Time limits: with ``timeout`` (``--timeout``), each clause may take that long, as a whole.
Without, each call of the function may take :data:`~.child.TIME_FACTOR` times what maskln's own
op takes on its case, or :data:`~.child.LOOP_FACTOR` times a plain Python loop over its rows,
measured in the child, at least :data:`~.child.FLOOR_SECONDS` (a hang
fails in seconds), and each clause :data:`CLAUSE_LIMIT` at most; a call's time leaves out what
the child waited for a CPU (:class:`_CallClock`). Importing the target is bounded
by ``timeout``, else :data:`CLAUSE_LIMIT`; the child's own start-up (Python, torch, the grader)
by :data:`START_TIMEOUT`.

The child caps its address space (``RLIMIT_AS``; :data:`~.child.DEFAULT_MEMORY_GIB`, or
``MASKLN_GRADE_MEMORY_GIB``) on the CPU, so an allocation beyond it fails the call that made
it ("out of memory (cap 4 GiB)") instead of the machine; a clause that runs out of time with the
child's address space at the cap (allocating, failing, retrying) is out of memory too. What it
prints, and any file it writes, is capped at :data:`~.child.OUTPUT_CAP`. It writes no bytecode
(no ``__pycache__`` beside the solution) and runs torch on one thread.

The processes the function starts are killed with the child (:mod:`.processes`); files the
grader loads are checked after the child ends, when the grader is sealed (:mod:`.guard`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

from maskln_cli.errors import MasklnError
from maskln_cli.grading import guard
from maskln_cli.grading.child import (
    DEFAULT_MEMORY_GIB,
    FLOOR_SECONDS,
    HEADER,
    LOOP_FACTOR,
    MAX_LABEL,
    MEMORY_BYTES_ENV,
    MEMORY_ENV,
    OUTPUT_CAP,
    PARENT_ENV,
    TIME_FACTOR,
    forked_main,
    gib,
    mib,
    start_command,
)
from maskln_cli.grading.processes import (
    GRACE_SECONDS,
    CpuWait,
    Forked,
    children,
    kill_descendants,
    kill_group,
    kill_session,
    protected_grader,
)

MAX_JSON = 16 << 20
MAX_DATA = 1 << 30
"""The largest frame the parent accepts: the clauses' tensors are a few MiB at most."""
GIVE_UP_AFTER = 2
"""Crashes or timeouts in a row after which the remaining clauses are not run."""
START_TIMEOUT = 60.0
"""How long the child may take to import torch and the grader (before the target: its import
is bounded by ``--timeout``, as each clause is)."""
CLAUSE_LIMIT = 60.0
"""Without ``--timeout``: the most a clause may take, whatever its calls' own limits (and the
most importing the target may take)."""
MEMORY_NEAR_CAP = 0.9
"""A child whose address space reached this share of its cap when it timed out was stopped by
the cap (allocating, failing, retrying), not by a slow computation."""


def memory_cap_bytes(gib_: float | None = None) -> int:
    """The child's address-space cap: ``gib_``, else ``MASKLN_GRADE_MEMORY_GIB``, else 4 GiB.

    Example:
        >>> memory_cap_bytes(0.5)
        536870912
    """
    if gib_ is None:
        text = os.environ.get(MEMORY_ENV)
        try:
            gib_ = float(text) if text else DEFAULT_MEMORY_GIB
        except ValueError:
            raise MasklnError(f"{MEMORY_ENV}: not a number of GiB: {text!r}") from None
    if not gib_ > 0:
        raise MasklnError(f"{MEMORY_ENV}: must be positive, got {gib_}")
    return int(gib_ * (1 << 30))


def preload() -> None:
    """Import what the grader uses once the child has run (the tensors' decoder), and what a
    forked child runs, and run maskln's op once (its native kernels loaded, or built, here: a
    child only times it): a solution runs as the same user and could change those files
    meanwhile (:mod:`.guard`)."""
    import safetensors.torch  # noqa: F401
    import torch

    from maskln_cli.grading import clauses, confine, rootcause, targets  # noqa: F401
    from maskln_cli.op.api import masked_layer_normalization

    with contextlib.suppress(Exception):  # the grader works without it: only slower children
        x = torch.ones(2, 3, requires_grad=True)
        out = masked_layer_normalization(x, torch.ones(2, dtype=torch.bool), torch.ones(3),
                                         torch.zeros(3))  # fmt: skip
        out.sum().backward()


def last_log_line(log: IO[bytes] | None) -> str:
    """The child's last printed line (its "Fatal Python error" line, when it crashed so)."""
    if log is None:
        return ""
    with contextlib.suppress(OSError):
        log.seek(0, os.SEEK_END)
        size = log.tell()
        log.seek(max(0, size - 8192))
        lines = [
            line.strip()
            for line in log.read().decode(errors="replace").splitlines()
            if line.strip()
        ]
        fatal = [line for line in lines if line.startswith("Fatal Python error")]
        chosen = fatal[-1] if fatal else (lines[-1] if lines else "")
        return chosen[:300]
    return ""


class ChildGone(Exception):
    """The child process ended (its reason in words) or timed out."""


class Sandbox:
    """The child process that runs the graded function; see the module docstring.

    ``timeout``: seconds each clause may take (``--timeout``); None: each call's own limit
    (:mod:`.child`). ``fork``: fork the child from this process (a class grade's worker, which
    imported everything and runs no other thread) rather than start it.

    Example (a context manager; the child is killed on exit):
        >>> with Sandbox("maskln_cli:masked_layer_normalization", "cpu", 60) as child:
        ...     child.start()
        ...     run = child.run_clause("worked_example", 0)
        >>> run.failure, sorted(run.tensors)
        (None, ['0.out'])
    """

    def __init__(
        self,
        target: str,
        device: str,
        timeout: float | None,
        memory_bytes: int | None = None,
        contain_processes: bool = False,
        fork: bool = False,
        op: str = "layer",
    ) -> None:
        self.target = target
        self.op = op
        self.contain_processes = contain_processes
        self.fork = fork
        self._protection: contextlib.ExitStack | None = None
        self._others: set[int] = set()
        self.device = device
        self.timeout = timeout
        cpu = device.split(":")[0] == "cpu"
        # CUDA reserves a large address space: a cap would break it, not bound it.
        self.memory_bytes = (memory_bytes or memory_cap_bytes()) if cpu else None
        self.process: subprocess.Popen[bytes] | Forked | None = None
        self.log: IO[bytes] | None = None
        self.channel: socket.socket | None = None
        self.buffer = bytearray()
        self.failures_in_a_row = 0
        self.failed_clauses: list[str] = []
        self.case: str | None = None
        self.call_limit: float | None = None
        self.peak_memory = 0
        self.private: PrivateFolder | None = None

    def __enter__(self) -> Sandbox:
        preload()  # what the parent uses later, imported before any submission runs
        self.private = PrivateFolder(self.target)
        self._protection = contextlib.ExitStack()
        self._protection.enter_context(protected_grader(self.contain_processes))
        self._others = children()  # not ours to kill
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            if self._protection is not None:
                self._protection.close()
                self._protection = None
            if self.private is not None:
                self.private.remove()
        guard.check()  # a sealed grader: nothing it loads changed meanwhile (else no verdict)

    # -- the process --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the child (it imports torch and the grader: up to :data:`START_TIMEOUT`), then
        have it import the target, within ``timeout`` (else :data:`CLAUSE_LIMIT`). Raises
        MasklnError (a usage error) when the target cannot be imported in time, is missing or
        not callable."""
        try:
            self._spawn()
            ready, _ = self._receive(START_TIMEOUT)
        except (ChildGone, TimeoutError) as error:
            self.stop()
            why = str(error) if isinstance(error, ChildGone) else f"not within {START_TIMEOUT:g} s"
            raise MasklnError(f"the grader's child process did not start: {why}") from None
        if not ready.get("ready"):
            self.stop()
            raise MasklnError(str(ready.get("error") or "the grader's child process did not start"))
        limit = self.timeout or CLAUSE_LIMIT
        try:
            self.private = private = self.private or PrivateFolder(self.target)
            self._send({"op": "load", "target": private.loaded, "shown": self.target,
                        "exercise": self.op, "device": self.device, "scratch": private.scratch,
                        "sealed_at": private.began, "allowed": private.allowed})  # fmt: skip
            answer, _ = self._receive(limit)
        except ChildGone as gone:
            self.stop()
            raise MasklnError(f"TARGET {self.target}: cannot import: {gone}") from None
        except TimeoutError:
            self.stop()
            option = "--timeout" if self.timeout else "the limit of a clause"
            raise MasklnError(
                f"TARGET {self.target}: cannot import: it did not finish within {limit:g} s"
                f" ({option})"
            ) from None
        if not answer.get("ok"):
            self.stop()
            raise MasklnError(str(answer.get("error") or f"TARGET {self.target}: cannot load"))

    def _spawn(self) -> None:
        self.stop()
        self.channel, theirs = socket.socketpair()
        # Kept open for the child's life (its stdout and stderr), closed in stop().
        self.log = tempfile.TemporaryFile()  # noqa: SIM115
        memory = self.memory_bytes or 0
        try:
            if self.fork:
                self.process = self._fork(theirs.fileno(), self.log.fileno(), memory)
            else:
                env = {**os.environ, PARENT_ENV: str(os.getpid())}
                if memory:
                    env[MEMORY_BYTES_ENV] = str(memory)
                self.process = subprocess.Popen(
                    start_command("maskln_cli.grading.child", str(theirs.fileno())),
                    stdin=subprocess.DEVNULL,
                    stdout=self.log,
                    stderr=self.log,
                    pass_fds=(theirs.fileno(),),
                    env=env,
                    start_new_session=True,  # its own process group: killed with all it started
                )
        finally:
            theirs.close()
        self.buffer.clear()

    @staticmethod
    def _fork(channel: int, log: int, memory: int) -> Forked:
        parent = os.getpid()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
            with contextlib.suppress(Exception):
                stream.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            forked_main(channel, log, parent, memory)
        return Forked(pid)

    def stop(self) -> None:
        """Kill the child, everything in its process group and its session, and (with
        ``contain_processes``) every process it detached that came back to this one; release
        its channel."""
        process, self.process = self.process, None
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if process is not None:
            kill_group(process)
            kill_session(process.pid)
            if self.contain_processes:
                kill_descendants(spare=self._others)
        if self.log is not None:
            self.log.close()
            self.log = None

    def _reason(self) -> str:
        """Why the child ended, from its exit status and the last line it printed."""
        process = self.process
        assert process is not None
        try:
            code = process.wait(GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            return "the child process stopped answering"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            what = {
                "SIGSEGV": " (a segmentation fault)",
                "SIGABRT": " (aborted)",
                "SIGKILL": f" (killed{self._memory_words()})",
                "SIGBUS": " (a bus error)",
                "SIGXFSZ": f" (it wrote more than the grader's cap of {mib(OUTPUT_CAP)})",
            }.get(name, "")
            reason = f"the process crashed: {name}{what}"
        else:
            reason = f"the process exited with code {code} in the middle of the clause"
        last = last_log_line(self.log)
        return f"{reason}; it printed: {last}" if last else reason

    # -- frames ---------------------------------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> None:
        assert self.channel is not None
        try:
            self.channel.sendall((json.dumps(message) + "\n").encode())
        except OSError:
            raise ChildGone(self._reason()) from None

    def _receive(self, limit: float, per_call: bool = False) -> tuple[dict[str, Any], bytes]:
        """The child's next answer, within ``limit`` seconds; with ``per_call``, each call
        within what the child's ticks say, too (bounded by ``limit``). A frame saying which
        case the child is on (``{"at": ...}``) is kept (:attr:`case`), the child's memory is
        sampled meanwhile (:attr:`peak_memory`). Raises TimeoutError, ChildGone."""
        assert self.channel is not None
        clock = _CallClock(limit)
        self.call_limit = None
        while True:
            frame = pop_frame(self.buffer)
            if frame is not None:
                keys = set(frame[0])
                if keys == {"at"}:
                    self.case = str(frame[0]["at"])[:MAX_LABEL]
                    continue
                if keys == {"tick"}:
                    if per_call and self.process is not None:
                        self.call_limit = _call_limit(frame[0]["tick"], limit)
                        clock.call(self.call_limit, self.process.pid)
                    continue
                return frame
            remaining = clock.remaining()
            if remaining <= 0:
                self._sample_memory()
                if clock.whole_ran_out:
                    self.call_limit = None  # the whole clause's limit ran out
                raise TimeoutError
            ready, _, _ = select.select([self.channel], [], [], min(remaining, 0.5))
            if not ready:
                self._sample_memory()
                continue
            try:
                chunk = self.channel.recv(1 << 20)
            except OSError:
                chunk = b""
            if not chunk:
                raise ChildGone(self._reason())
            self.buffer += chunk

    # -- clauses --------------------------------------------------------------------------------

    def run_clause(self, name: str, seed: int) -> Any:
        """Run clause ``name`` in the child; a :class:`~maskln_cli.grading.clauses.ClauseRun` whose
        ``failure`` says why when the child crashed, hung or could not be (re)started."""
        from maskln_cli.grading.clauses import ClauseRun

        if self.failures_in_a_row >= GIVE_UP_AFTER:
            names = ", ".join(self.failed_clauses[-GIVE_UP_AFTER:])
            return ClauseRun(
                failure=f"not run: the function crashed or hung in {GIVE_UP_AFTER} clauses in a"
                f" row ({names})"
            )
        if self.process is None:
            try:
                self.start()
            except MasklnError as error:
                return self._failed(name, ClauseRun(failure=f"could not restart: {error}"))
        self.case = None
        per_call = self.timeout is None
        try:
            self._send({"op": "run", "clause": name, "seed": seed, "per_call": per_call})
            header, data = self._receive(self.timeout or CLAUSE_LIMIT, per_call)
        except TimeoutError:
            failure = self._timeout_words()
            self.stop()
            guard.check()
            return self._failed(name, ClauseRun(failure=failure))
        except ChildGone as gone:
            self.stop()
            guard.check()
            return self._failed(name, ClauseRun(failure=str(gone)))
        self.failures_in_a_row = 0
        return decode_run(header, data)

    def _timeout_words(self) -> str:
        """Why the clause ran out of time (:func:`timeout_words`)."""
        near_cap = bool(self.memory_bytes) and (
            self.peak_memory >= MEMORY_NEAR_CAP * (self.memory_bytes or 0)
        )
        held = self.peak_memory if near_cap else None
        return timeout_words(self.case, self.timeout, self.call_limit, self.memory_bytes, held)

    def _sample_memory(self) -> None:
        """Keep the child's largest address space seen (VmSize, Linux: a forked child starts
        with its worker's peak, which is not its own)."""
        if self.process is None:
            return
        with (
            contextlib.suppress(OSError, ValueError),
            open(f"/proc/{self.process.pid}/status") as status,
        ):
            for line in status:
                if line.startswith("VmSize:"):
                    self.peak_memory = max(self.peak_memory, int(line.split()[1]) * 1024)

    def _memory_words(self) -> str:
        """``: out of memory?``, or what the child held, when it was near its cap."""
        if self.memory_bytes and self.peak_memory >= MEMORY_NEAR_CAP * self.memory_bytes:
            return f": out of memory, the process held {gib(self.peak_memory)}"
        return ": out of memory?"

    def _failed(self, name: str, run: Any) -> Any:
        self.failures_in_a_row += 1
        self.failed_clauses.append(name)
        return run


def run_probe(
    child: Sandbox,
    clause: str,
    seed: int,
    case: int,
    mistake: str,
    spec: dict[str, Any],
    salt: int,
) -> Any:
    """Run the probe of ``mistake`` on case ``case`` of ``clause`` in ``child``
    (:mod:`.confirm`): a ClauseRun, or None when the child cannot (it crashed or hung twice in
    a row, or now: no cause is then confirmed)."""
    if child.failures_in_a_row >= GIVE_UP_AFTER:
        return None
    if child.process is None:
        try:
            child.start()
        except MasklnError:
            return None
    request = {"op": "probe", "clause": clause, "seed": seed, "case": case, "mistake": mistake,
               "spec": spec, "salt": salt, "per_call": child.timeout is None}  # fmt: skip
    try:
        child._send(request)
        header, data = child._receive(child.timeout or CLAUSE_LIMIT, child.timeout is None)
    except (TimeoutError, ChildGone):
        child.stop()
        guard.check()
        return None
    run = decode_run(header, data)
    return None if run.failure is not None else run


class PrivateFolder:
    """A grade's private folder: a read-only copy of a file target, alone (what the child
    imports), and a scratch folder (the child's current folder and TMPDIR), removed with
    :meth:`remove`; and the moment the grade began, from which the child imports nothing
    written (the grader's seal, else now: :func:`~.guard.seal_child_imports`)."""

    def __init__(self, target: str) -> None:
        from maskln_cli.grading.targets import private_copy

        self.began = guard.sealed_at() or time.time_ns()
        self.path = tempfile.mkdtemp(prefix=folder_prefix(os.getpid()))
        copies = os.path.join(self.path, "submission")
        self.scratch = os.path.join(self.path, "scratch")
        os.mkdir(copies)
        os.mkdir(self.scratch, 0o700)
        self.loaded = private_copy(target, copies)
        self.allowed = [self.loaded.rpartition(":")[0]] if self.loaded != target else []

    def remove(self) -> None:
        remove_folder(self.path)


def folder_prefix(pid: int) -> str:
    """The name's start of the private folders process ``pid`` makes: a class grade finds
    those of a worker it lost by it (killed, the worker could not remove them)."""
    return f"maskln-grade-{pid}-"


def remove_folders_of(pid: int) -> None:
    """Remove the private folders that process ``pid``, ended, left in the temporary folder
    (folders only: a link of that name is not followed)."""
    import glob

    pattern = os.path.join(glob.escape(tempfile.gettempdir()), glob.escape(folder_prefix(pid)))
    for path in glob.glob(pattern + "*"):
        if os.path.isdir(path) and not os.path.islink(path):
            remove_folder(path)


def remove_folder(path: str) -> None:
    """Remove a grade's private folder, whatever modes the submission gave what it wrote."""
    import shutil

    if not path:
        return

    def writable(function: Any, failed: str, _: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(failed), 0o700)
            os.chmod(failed, 0o700)
            function(failed)

    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)
        for root, folders, _ in os.walk(path):
            for folder in folders:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(root, folder), 0o700)
        shutil.rmtree(path, onerror=writable)


def pop_frame(buffer: bytearray) -> tuple[dict[str, Any], bytes] | None:
    """The first whole frame in ``buffer`` (taken out of it), or None while it is not whole.
    Raises ChildGone for what is not a frame."""
    if len(buffer) < HEADER.size:
        return None
    json_size, data_size = HEADER.unpack_from(buffer)
    if json_size > MAX_JSON or data_size > MAX_DATA:
        raise ChildGone("the child process sent a malformed answer")
    end = HEADER.size + json_size + data_size
    if len(buffer) < end:
        return None
    try:
        header = json.loads(bytes(buffer[HEADER.size : HEADER.size + json_size]))
    except ValueError:
        raise ChildGone("the child process sent a malformed answer") from None
    data = bytes(buffer[HEADER.size + json_size : end])
    del buffer[:end]
    if not isinstance(header, dict):
        raise ChildGone("the child process sent a malformed answer")
    return header, data


def timeout_words(
    case: str | None,
    timeout: float | None,
    call_limit: float | None,
    memory_bytes: int | None,
    held: int | None,
) -> str:
    """Why a clause ran out of time: the memory cap, when the child ``held`` near it
    (allocating, failing and retrying); else a hang or slowness, in which case, and the limit
    that ran out: ``timeout`` (``--timeout``), a call's own (``call_limit``), or the clause's.

    Example:
        >>> timeout_words("x [2, 3]", None, 5.0, None, None)[:42]
        'timed out after 5 s in the case x [2, 3] ('
    """
    where = f" in the case {case}" if case else ""
    limit = call_limit or timeout or CLAUSE_LIMIT
    if memory_bytes and held is not None:
        return (
            f"out of memory (cap {gib(memory_bytes)}, {MEMORY_ENV}): the process held"
            f" {gib(held)} when its {limit:.3g} s ran out{where}"
        )
    if timeout is not None:
        return f"timed out after {timeout:g} s{where} (the function hung, or is that slow)"
    if call_limit is None:
        return (
            f"timed out after {CLAUSE_LIMIT:g} s, the limit of a clause,{where} (the function"
            " is that slow; --timeout SECONDS sets another)"
        )
    return (
        f"timed out after {call_limit:.3g} s{where} (the function hung, or is that slow: a call"
        f" may take {TIME_FACTOR:g} times what maskln's op takes on its case, or"
        f" {LOOP_FACTOR:g} times a Python loop over its rows, at least {FLOOR_SECONDS:g} s;"
        " --timeout SECONDS gives each clause one limit instead)"
    )


class _CallClock:
    """The deadlines of a wait for the child: the whole clause's, and the current call's. A
    call's limit is of its own time: what its process waited for a CPU (a loaded machine) is
    not counted (:class:`~.processes.CpuWait`). A hang that sleeps never waits for one; one
    that spins under load is stopped by the clause's limit at the latest."""

    def __init__(self, limit: float) -> None:
        self.whole = time.monotonic() + limit
        self.deadline = self.whole
        self.started = 0.0
        self.limit = 0.0
        self.waited: CpuWait | None = None

    def call(self, limit: float, pid: int) -> None:
        """A call begins, which may take ``limit`` seconds of its own."""
        self.started, self.limit = time.monotonic(), limit
        self.deadline = min(self.whole, self.started + limit)
        self.waited = CpuWait(pid)

    def remaining(self) -> float:
        """Seconds until a deadline (<= 0: one passed), the call's moved by its CPU wait."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0 and self.waited is not None and self.deadline < self.whole:
            later = min(self.whole, self.started + self.limit + self.waited.seconds())
            if later - self.deadline > 0.01:
                self.deadline = later
                remaining = later - time.monotonic()
        return remaining

    @property
    def whole_ran_out(self) -> bool:
        return self.deadline >= self.whole


def _call_limit(told: Any, limit: float) -> float:
    """What the child says a call may take, as a number of seconds between the floor and the
    clause's ``limit`` (the child is the submission's: it may only lengthen its own wait)."""
    try:
        seconds = float(told)
    except (TypeError, ValueError):
        return FLOOR_SECONDS
    if not math.isfinite(seconds):
        return limit
    return min(limit, max(FLOOR_SECONDS, seconds))


# --- deserializing a clause's run --------------------------------------------------------------


def decode_run(header: dict[str, Any], data: bytes) -> Any:
    """A ClauseRun from the child's answer, checked: anything malformed fails the clause."""
    from safetensors.torch import load

    from maskln_cli.grading.clauses import ClauseRun

    meta, errors, failure = header.get("meta"), header.get("errors"), header.get("failure")
    well_formed = (
        isinstance(meta, dict)
        and all(isinstance(k, str) and isinstance(v, dict) for k, v in meta.items())
        and isinstance(errors, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in errors.items())
        and (failure is None or isinstance(failure, str))
    )
    if not well_formed:
        return ClauseRun(failure="the child process sent a malformed answer")
    try:
        tensors = load(data) if data else {}
    except Exception:  # safetensors raises its own error types on a corrupt buffer
        return ClauseRun(failure="the child process sent malformed tensors")
    return ClauseRun(tensors=tensors, meta=meta, errors=errors, failure=failure)
