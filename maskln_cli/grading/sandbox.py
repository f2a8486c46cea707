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
it ("out of memory (cap 4 GiB)") instead of the machine; a clause that runs out of time with the
child's address space at the cap (allocating, failing, retrying) is out of memory too. What it
prints, and any file it writes, is capped at :data:`OUTPUT_CAP`. Before each call the child
says which case it is on (``{"at": ...}``), so a timeout names it. It writes no bytecode (no
``__pycache__`` beside the solution) and runs torch on one thread.

The processes the function starts are killed with the child (:mod:`.processes`); files the
grader loads are checked after the child ends, when the grader is sealed (:mod:`.guard`).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from maskln_cli.errors import MasklnError
from maskln_cli.grading import guard
from maskln_cli.grading.processes import (
    GRACE_SECONDS,
    children,
    die_with_parent,
    kill_descendants,
    kill_group,
    kill_session,
    protected_grader,
)

HEADER = struct.Struct(">QQ")
MAX_JSON = 16 << 20
MAX_DATA = 1 << 30
"""The largest frame the parent accepts: the clauses' tensors are a few MiB at most."""
DEFAULT_MEMORY_GIB = 4.0
MEMORY_ENV = "MASKLN_GRADE_MEMORY_GIB"
GIVE_UP_AFTER = 2
"""Crashes or timeouts in a row after which the remaining clauses are not run."""
START_TIMEOUT = 60.0
"""How long the child may take to import torch and the grader (before the target: its import
is bounded by ``--timeout``, as each clause is)."""
OUTPUT_CAP = 64 << 20
"""What the child may print (its stdout and stderr go to a temporary file), and the largest
file it may write (``RLIMIT_FSIZE``)."""
MEMORY_NEAR_CAP = 0.9
"""A child whose address space reached this share of its cap when it timed out was stopped by
the cap (allocating, failing, retrying), not by a slow computation."""
MAX_LABEL = 300
"""The longest case label the child may send (it names the case a timeout happened in)."""


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
    return f"{count / (1 << 30):.3g} GiB"


def _mib(count: int) -> str:
    return f"{count / (1 << 20):g} MiB"


def preload() -> None:
    """Import what the grader uses once the child has run (the tensors' decoder): a solution
    runs as the same user and could change those files meanwhile (:mod:`.guard`)."""
    import safetensors.torch  # noqa: F401

    from maskln_cli.grading import clauses, rootcause  # noqa: F401


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
        self.case: str | None = None
        self.peak_memory = 0

    def __enter__(self) -> Sandbox:
        preload()  # what the parent uses later, imported before any submission runs
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
        guard.check()  # a sealed grader: nothing it loads changed meanwhile (else no verdict)

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
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # nothing written beside the solution
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
                "SIGXFSZ": f" (it wrote more than the grader's cap of {_mib(OUTPUT_CAP)})",
            }.get(name, "")
            reason = f"the process crashed: {name}{what}"
        else:
            reason = f"the process exited with code {code} in the middle of the clause"
        last = last_log_line(self.log)
        return f"{reason}; it printed: {last}" if last else reason

    # -- frames ---------------------------------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.requests, data) :]
        except OSError:
            raise ChildGone(self._reason()) from None

    def _receive(self, timeout: float) -> tuple[dict[str, Any], bytes]:
        """The child's next answer; a frame saying which case it is on (``{"at": ...}``) is
        kept (:attr:`case`), the child's memory is sampled meanwhile (:attr:`peak_memory`)."""
        deadline = time.monotonic() + timeout
        while True:
            frame = self._frame()
            if frame is not None:
                if set(frame[0]) == {"at"}:
                    self.case = str(frame[0]["at"])[:MAX_LABEL]
                    continue
                return frame
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._sample_memory()
                raise TimeoutError
            ready, _, _ = select.select([self.responses], [], [], min(remaining, 0.5))
            if not ready:
                self._sample_memory()
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
        self.case = None
        try:
            self._send({"op": "run", "clause": name, "seed": seed})
            header, data = self._receive(self.timeout)
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
        """Why the clause ran out of time: the memory cap, when the child's address space was
        at it (allocating, failing and retrying); else a hang or slowness, and in which case."""
        where = f" in the case {self.case}" if self.case else ""
        if self.memory_bytes and self.peak_memory >= MEMORY_NEAR_CAP * self.memory_bytes:
            return (
                f"out of memory (cap {_gib(self.memory_bytes)}, {MEMORY_ENV}): the process"
                f" held {_gib(self.peak_memory)} when the clause's {self.timeout:g} s ran out"
                f"{where}"
            )
        return f"timed out after {self.timeout:g} s{where} (the function hung, or is that slow)"

    def _sample_memory(self) -> None:
        """Keep the child's largest address space seen (VmPeak, Linux)."""
        if self.process is None:
            return
        with (
            contextlib.suppress(OSError, ValueError),
            open(f"/proc/{self.process.pid}/status") as status,
        ):
            for line in status:
                if line.startswith("VmPeak:"):
                    self.peak_memory = max(self.peak_memory, int(line.split()[1]) * 1024)

    def _memory_words(self) -> str:
        """``: out of memory?``, or what the child held, when it was near its cap."""
        if self.memory_bytes and self.peak_memory >= MEMORY_NEAR_CAP * self.memory_bytes:
            return f": out of memory, the process held {_gib(self.peak_memory)}"
        return ": out of memory?"

    def _failed(self, name: str, run: Any) -> Any:
        self.failures_in_a_row += 1
        self.failed_clauses.append(name)
        return run


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


def _limit_resources() -> None:
    import resource

    memory = os.environ.pop("_MASKLN_GRADE_MEMORY_BYTES", None)
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (int(memory), int(memory)))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a segfault leaves no core file
    resource.setrlimit(resource.RLIMIT_FSIZE, (OUTPUT_CAP, OUTPUT_CAP))


def _limits_named(message: str, memory: int) -> str:
    """An error the grader's own limits caused, said so: the memory cap, the output cap."""
    if memory and message.startswith("out of memory"):
        return f"out of memory (cap {_gib(memory)}, {MEMORY_ENV}): {message[15:]}"
    if "[Errno 27]" in message:  # EFBIG: RLIMIT_FSIZE
        return (
            f"it wrote more than the grader's cap of {_mib(OUTPUT_CAP)} (what it prints, and any"
            f" file it writes): {message}"
        )
    return message


def child_main(argv: list[str]) -> int:
    """The child's loop: load the target, then run clauses until the requests pipe closes."""
    request_fd, response_fd = int(argv[0]), int(argv[1])
    memory = int(os.environ.get("_MASKLN_GRADE_MEMORY_BYTES") or 0)
    die_with_parent(os.environ.pop("_MASKLN_GRADE_PARENT", None))
    _limit_resources()
    sys.dont_write_bytecode = True  # whatever the environment says: no __pycache__ beside it
    requests = os.fdopen(request_fd, "rb")
    try:  # torch and the grader: the parent waits START_TIMEOUT for this, then --timeout
        import torch

        from maskln_cli.grading import clauses, targets
        from maskln_cli.grading.clauses import calls
    except MemoryError:
        cap = f" (cap {_gib(memory)})" if memory else ""
        _write_frame(response_fd, {"ready": False, "error": f"out of memory importing torch{cap}"})
        return 0
    torch.set_num_threads(1)  # small cases; and torch's thread pool spins under load
    calls.watch_calls(lambda what: _write_frame(response_fd, {"at": what[:MAX_LABEL]}))
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
        run.errors = {key: _limits_named(message, memory) for key, message in run.errors.items()}
        if run.failure is not None:
            run.failure = _limits_named(run.failure, memory)
        header, data = encode_run(run)
        _write_frame(response_fd, header, data)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
