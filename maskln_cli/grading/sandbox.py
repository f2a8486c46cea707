"""The child process of ``maskln grade``: the graded function runs there, never in the grader.

The parent (:class:`Sandbox`) starts ``python -m maskln_cli.grading.sandbox`` once, has it import
the target, then asks it to run one clause at a time. The child builds the clause's cases from the
seed (the same code the parent uses), calls the function and sends back what it computed:
tensors as safetensors bytes and facts as JSON (never pickle), which the parent judges against
cases it built itself. So a function that patches torch in its own process cannot change a
verdict on values. A crash or a hang costs the clause it happened in: the parent kills the
child (SIGTERM, then SIGKILL after a grace period), and starts a new one for the next clause;
after :data:`GIVE_UP_AFTER` such failures in a row, the remaining clauses are not run.

Protocol, over two pipes the parent creates:

- parent -> child: one JSON object per line, ``{"op": "load", "target": ...}`` first, then
  ``{"op": "run", "clause": ..., "seed": ...}``;
- child -> parent: frames of a 16-byte header (JSON length, data length: big-endian u64),
  the JSON (``{"ready": ...}`` once torch and the grader are imported, before the load;
  ``{"ok": ...}`` for a load; ``{"meta", "errors", "failure"}`` for a run), then the data
  (safetensors bytes, possibly empty).

Importing the target is bounded by the clauses' timeout (``--timeout``); the child's own
start-up (Python, torch, the grader) by :data:`START_TIMEOUT`.

The child caps its address space (``RLIMIT_AS``; :data:`DEFAULT_MEMORY_GIB`, or
``MASKLN_GRADE_MEMORY_GIB``) on the CPU, so an allocation beyond it fails the call that made
it ("out of memory (cap 4 GiB)") instead of the machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from pathlib import Path
from typing import IO, Any

from maskln_cli.errors import MasklnError

HEADER = struct.Struct(">QQ")
MAX_JSON = 16 << 20
MAX_DATA = 1 << 30
"""The largest frame the parent accepts: the clauses' tensors are a few MiB at most."""
DEFAULT_MEMORY_GIB = 4.0
MEMORY_ENV = "MASKLN_GRADE_MEMORY_GIB"
GRACE_SECONDS = 1.0
"""Between SIGTERM and SIGKILL."""
GIVE_UP_AFTER = 2
"""Crashes or timeouts in a row after which the remaining clauses are not run."""
START_TIMEOUT = 60.0
"""How long the child may take to import torch and the grader (before the target: its import
is bounded by ``--timeout``, as each clause is)."""
_FILE_SIZE_LIMIT = 64 << 20
"""What the child may print (its stdout and stderr go to a temporary file)."""


def memory_cap_bytes(gib: float | None = None) -> int:
    """The child's address-space cap: ``gib``, else ``MASKLN_GRADE_MEMORY_GIB``, else 4 GiB.

    Example:
        >>> memory_cap_bytes(0.5)
        536870912
    """
    if gib is None:
        text = os.environ.get(MEMORY_ENV)
        try:
            gib = float(text) if text else DEFAULT_MEMORY_GIB
        except ValueError:
            raise MasklnError(f"{MEMORY_ENV}: not a number of GiB: {text!r}") from None
    if not gib > 0:
        raise MasklnError(f"{MEMORY_ENV}: must be positive, got {gib}")
    return int(gib * (1 << 30))


def _gib(count: int) -> str:
    return f"{count / (1 << 30):g} GiB"


class ChildGone(Exception):
    """The child process ended (its reason in words) or timed out."""


class Sandbox:
    """The child process that runs the graded function; see the module docstring.

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
        timeout: float,
        memory_bytes: int | None = None,
        contain_processes: bool = False,
    ) -> None:
        self.target = target
        self.contain_processes = contain_processes
        self._protection: contextlib.ExitStack | None = None
        self._others: set[int] = set()
        self.device = device
        self.timeout = timeout
        cpu = device.split(":")[0] == "cpu"
        # CUDA reserves a large address space: a cap would break it, not bound it.
        self.memory_bytes = (memory_bytes or memory_cap_bytes()) if cpu else None
        self.process: subprocess.Popen[bytes] | None = None
        self.log: IO[bytes] | None = None
        self.requests = -1
        self.responses = -1
        self.buffer = bytearray()
        self.failures_in_a_row = 0
        self.failed_clauses: list[str] = []

    def __enter__(self) -> Sandbox:
        self._protection = contextlib.ExitStack()
        self._protection.enter_context(protected_grader(self.contain_processes))
        me = os.getpid()
        self._others = {pid for pid, ppid, _ in _processes() if ppid == me}  # not ours to kill
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            if self._protection is not None:
                self._protection.close()
                self._protection = None

    # -- the process --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the child (it imports torch and the grader: up to :data:`START_TIMEOUT`), then
        have it import the target, within ``timeout`` (``--timeout``). Raises MasklnError (a
        usage error) when the target cannot be imported in time, is missing or not callable."""
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
        try:
            self._send({"op": "load", "target": self.target, "device": self.device})
            answer, _ = self._receive(self.timeout)
        except ChildGone as gone:
            self.stop()
            raise MasklnError(f"TARGET {self.target}: cannot import: {gone}") from None
        except TimeoutError:
            self.stop()
            raise MasklnError(
                f"TARGET {self.target}: cannot import: it did not finish within"
                f" {self.timeout:g} s (--timeout)"
            ) from None
        if not answer.get("ok"):
            self.stop()
            raise MasklnError(str(answer.get("error") or f"TARGET {self.target}: cannot load"))

    def _spawn(self) -> None:
        self.stop()
        request_read, self.requests = os.pipe()
        self.responses, response_write = os.pipe()
        # Kept open for the child's life (its stdout and stderr), closed in stop().
        self.log = tempfile.TemporaryFile()  # noqa: SIM115
        package_root = str(Path(__file__).resolve().parent.parent)
        path = os.environ.get("PYTHONPATH")
        env = {
            **os.environ,
            "PYTHONPATH": package_root + (os.pathsep + path if path else ""),
            "PYTHONFAULTHANDLER": "1",  # a segfault leaves "Fatal Python error" in the log
            "PYTHONUNBUFFERED": "1",
        }
        if self.memory_bytes:
            env["_MASKLN_GRADE_MEMORY_BYTES"] = str(self.memory_bytes)
        env["_MASKLN_GRADE_PARENT"] = str(os.getpid())
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "maskln_cli.grading.sandbox",
                    str(request_read),
                    str(response_write),
                ],
                stdin=subprocess.DEVNULL,
                stdout=self.log,
                stderr=self.log,
                pass_fds=(request_read, response_write),
                env=env,
                start_new_session=True,  # its own process group: killed with all it started
            )
        finally:
            os.close(request_read)
            os.close(response_write)
        self.buffer.clear()

    def stop(self) -> None:
        """Kill the child, everything in its process group and its session, and (with
        ``contain_processes``) every process it detached that came back to this one; release
        its pipes."""
        process, self.process = self.process, None
        for fd in (self.requests, self.responses):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.requests = self.responses = -1
        if process is not None:
            _kill_group(process)
            _kill_session(process.pid)
            if self.contain_processes:
                _kill_adopted(spare=self._others)
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
                "SIGKILL": " (killed: out of memory?)",
                "SIGBUS": " (a bus error)",
                "SIGXFSZ": " (it printed too much)",
            }.get(name, "")
            reason = f"the process crashed: {name}{what}"
        else:
            reason = f"the process exited with code {code} in the middle of the clause"
        last = self._last_log_line()
        return f"{reason}; it printed: {last}" if last else reason

    def _last_log_line(self) -> str:
        if self.log is None:
            return ""
        with contextlib.suppress(OSError):
            self.log.seek(0, os.SEEK_END)
            size = self.log.tell()
            self.log.seek(max(0, size - 8192))
            lines = [
                line.strip()
                for line in self.log.read().decode(errors="replace").splitlines()
                if line.strip()
            ]
            fatal = [line for line in lines if line.startswith("Fatal Python error")]
            chosen = fatal[-1] if fatal else (lines[-1] if lines else "")
            return chosen[:300]
        return ""

    # -- frames ---------------------------------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.requests, data) :]
        except OSError:
            raise ChildGone(self._reason()) from None

    def _receive(self, timeout: float) -> tuple[dict[str, Any], bytes]:
        deadline = time.monotonic() + timeout
        while True:
            frame = self._frame()
            if frame is not None:
                return frame
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            ready, _, _ = select.select([self.responses], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(self.responses, 1 << 20)
            if not chunk:
                raise ChildGone(self._reason())
            self.buffer += chunk

    def _frame(self) -> tuple[dict[str, Any], bytes] | None:
        if len(self.buffer) < HEADER.size:
            return None
        json_size, data_size = HEADER.unpack_from(self.buffer)
        if json_size > MAX_JSON or data_size > MAX_DATA:
            raise ChildGone("the child process sent a malformed answer")
        end = HEADER.size + json_size + data_size
        if len(self.buffer) < end:
            return None
        try:
            header = json.loads(bytes(self.buffer[HEADER.size : HEADER.size + json_size]))
        except ValueError:
            raise ChildGone("the child process sent a malformed answer") from None
        data = bytes(self.buffer[HEADER.size + json_size : end])
        del self.buffer[:end]
        if not isinstance(header, dict):
            raise ChildGone("the child process sent a malformed answer")
        return header, data

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
        try:
            self._send({"op": "run", "clause": name, "seed": seed})
            header, data = self._receive(self.timeout)
        except TimeoutError:
            self.stop()
            failure = f"timed out after {self.timeout:g} s (the function hung, or is that slow)"
            return self._failed(name, ClauseRun(failure=failure))
        except ChildGone as gone:
            self.stop()
            return self._failed(name, ClauseRun(failure=str(gone)))
        self.failures_in_a_row = 0
        return decode_run(header, data)

    def _failed(self, name: str, run: Any) -> Any:
        self.failures_in_a_row += 1
        self.failed_clauses.append(name)
        return run


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the child's process group, then SIGKILL after a grace period."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(GRACE_SECONDS)
        os.killpg(process.pid, signal.SIGKILL)  # what it started, too
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(GRACE_SECONDS)


def _kill_session(session: int) -> None:
    """SIGKILL what is left of the child's session (it is the session's leader: ``session`` is
    its pid): processes that left its process group with setpgid, not those that left the
    session with setsid (:func:`_kill_adopted` finds those)."""
    for pid, _, sid in _processes():
        if sid == session and pid != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _kill_adopted(spare: Collection[int] = (), rounds: int = 20) -> None:
    """SIGKILL and reap this process's children: as a child subreaper (:func:`protected_grader`
    with ``contain``) and with the child stopped, they are processes the function started and
    detached (a double fork, setsid), which came back to this process when their parents
    ended (``spare``: children this process had before the grade). Killing one may orphan its
    own children: repeat until none is left."""
    me = os.getpid()
    for _ in range(rounds):
        children = [pid for pid, ppid, _ in _processes() if ppid == me and pid not in spare]
        if not children:
            return
        for pid in children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _processes() -> list[tuple[int, int, int]]:
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


# prctl(2) options (linux/prctl.h)
PR_SET_PDEATHSIG = 1
PR_GET_DUMPABLE = 3
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37


def _prctl(option: int, value: int | ctypes.c_int = 0) -> int | None:
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
def protected_grader(contain: bool = False):
    """While grading (Linux; elsewhere nothing): this process is not dumpable, so a process of
    the same user that is not root cannot open its /proc/<pid>/fd (write into its stdout) or
    ptrace it; with ``contain``, it is a child subreaper, so processes the function detaches
    come back to it to be killed (:func:`_kill_adopted`; for a process that does nothing else,
    the command). Both are restored afterwards."""
    dumpable = _prctl(PR_GET_DUMPABLE)
    if dumpable:
        _prctl(PR_SET_DUMPABLE, 0)
    subreaper = None
    if contain:
        flag = ctypes.c_int(0)
        if _prctl(PR_GET_CHILD_SUBREAPER, flag) is not None and not flag.value:
            subreaper = _prctl(PR_SET_CHILD_SUBREAPER, 1)
    try:
        yield
    finally:
        if subreaper is not None:
            _prctl(PR_SET_CHILD_SUBREAPER, 0)
        if dumpable:
            _prctl(PR_SET_DUMPABLE, dumpable)


# --- (de)serializing a clause's run ---------------------------------------------------------------


def encode_run(run: Any) -> tuple[dict[str, Any], bytes]:
    """A ClauseRun as JSON and safetensors bytes."""
    from safetensors.torch import save

    header = {"meta": run.meta, "errors": run.errors, "failure": run.failure}
    return header, save({k: v.contiguous() for k, v in run.tensors.items()})


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


# --- the child ------------------------------------------------------------------------------------


def _write_frame(fd: int, header: dict[str, Any], data: bytes = b"") -> None:
    encoded = json.dumps(header).encode()
    frame = HEADER.pack(len(encoded), len(data)) + encoded + data
    view = memoryview(frame)
    while view:
        view = view[os.write(fd, view) :]


def _die_with_the_grader() -> None:
    """SIGKILL this child when the grader ends (killed by the function, say), rather than
    leave it running; if the grader is gone already, end now."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = os.environ.pop("_MASKLN_GRADE_PARENT", None)
    if parent is not None and str(os.getppid()) != parent:
        os._exit(1)


def _limit_resources() -> None:
    import resource

    memory = os.environ.pop("_MASKLN_GRADE_MEMORY_BYTES", None)
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (int(memory), int(memory)))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a segfault leaves no core file
    resource.setrlimit(resource.RLIMIT_FSIZE, (_FILE_SIZE_LIMIT, _FILE_SIZE_LIMIT))


def child_main(argv: list[str]) -> int:
    """The child's loop: load the target, then run clauses until the requests pipe closes."""
    request_fd, response_fd = int(argv[0]), int(argv[1])
    memory = int(os.environ.get("_MASKLN_GRADE_MEMORY_BYTES") or 0)
    _die_with_the_grader()
    _limit_resources()
    requests = os.fdopen(request_fd, "rb")
    try:  # torch and the grader: the parent waits START_TIMEOUT for this, then --timeout
        from maskln_cli.grading import clauses, targets
    except MemoryError:
        cap = f" (cap {_gib(memory)})" if memory else ""
        _write_frame(response_fd, {"ready": False, "error": f"out of memory importing torch{cap}"})
        return 0
    _write_frame(response_fd, {"ready": True})
    load = json.loads(requests.readline() or b"{}")
    try:
        target = str(load.get("target"))
        fn = targets.load_target(target)
        maskln = targets.is_maskln_target(target)
    except MasklnError as error:
        _write_frame(response_fd, {"ok": False, "error": str(error)})
        return 0
    except MemoryError:
        cap = f" (cap {_gib(memory)})" if memory else ""
        _write_frame(response_fd, {"ok": False, "error": f"out of memory importing it{cap}"})
        return 0
    device = str(load.get("device") or "cpu")
    _write_frame(response_fd, {"ok": True})
    for line in requests:
        request = json.loads(line)
        if request.get("op") != "run":
            break
        run = clauses.run_clause(
            fn, str(request["clause"]), int(request["seed"]), device, maskln=maskln
        )
        if memory:
            for key, message in run.errors.items():
                if message.startswith("out of memory"):
                    run.errors[key] = f"out of memory (cap {_gib(memory)}): {message[15:]}"
        header, data = encode_run(run)
        _write_frame(response_fd, header, data)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
