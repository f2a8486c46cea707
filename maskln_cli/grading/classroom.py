"""Grading a whole class: many targets, each in a child process of its own, several at a time.

:func:`grade_class` starts ``jobs`` worker processes (:mod:`.worker`), hands each the next target
as it becomes free, and collects the reports in target order. A submission that hangs or crashes
costs only its own time (its calls' and clauses' time limits; its worker kills its child).
Ctrl-C stops every worker, and their children, and returns what was graded so far. This module
imports no torch: the grading happens in the workers.

What no submission can do (Linux; the threat model is ``docs/grading/sandbox.md``):

- **Answer for a worker.** Each worker's only channel is a Unix socket this process created
  (``/proc/<pid>/fd`` cannot open a socket); each request carries a random nonce its answer must
  repeat, and an answer that does not, or comes unasked, is taken for a lost worker's.
- **Reach a worker.** Workers are not dumpable from their first line of Python; their children
  are forked, never dumpable either, and confined (:mod:`.confine`): no signal outside their
  own process group, no ptrace, no capability.
- **Turn a lost worker into a verdict.** A worker that ends, hangs past its safety limit or
  answers out of turn is replaced, and its target graded again on a fresh worker; lost twice,
  the target's row is a grader error (FAIL), never a verdict of its own.
- **Race a fresh worker.** A worker is started only while no submission runs: the others finish
  their targets first, every process left under this one is killed, the files every worker
  loads are checked, and only then does it start (and no target is sent before it is ready and
  not dumpable).
- **Plant code.** The files the first workers loaded (modules, bytecode, shared libraries) and
  the folders they import from are recorded before any submission runs, and checked after each
  target and before each worker starts; a worker started later is sealed from the moment the
  first ones were ready (:mod:`.guard`): it refuses to import a file changed since. When one
  changed, no later verdict can be trusted: the class grade stops there, saying so
  (``problem``).
- **Change a neighbour's file.** The submissions' files (and every ``*.py`` beside them) are
  recorded before any submission runs, and checked after each target: a change stops the class
  grade the same way.

This process is a child subreaper meanwhile, so that nothing a submission started outlives the
class grade, and not dumpable (:mod:`.processes`).
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import json
import os
import secrets
import select
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from maskln_cli.errors import MasklnError
from maskln_cli.grading import guard
from maskln_cli.grading.child import start_command
from maskln_cli.grading.processes import (
    GRACE_SECONDS,
    children,
    kill_descendants,
    protected_grader,
)
from maskln_cli.grading.report import GradeReport
from maskln_cli.grading.sandbox import CLAUSE_LIMIT, remove_folders_of
from maskln_cli.grading.selection import CLAUSE_LEVELS
from maskln_cli.grading.selection import select as select_clauses
from maskln_cli.grading.worker import PARENT_ENV, SEALED_ENV

WORKER_START = 120.0
"""Seconds a worker may take to start (Python, torch and the grader imported), and beyond its
clauses' time limits for one target."""
ATTEMPTS = 2
"""How many workers a target may lose before its row is a grader error."""

OnReport = Callable[[GradeReport, int, int], None]
"""Told ``(report, graded, total)`` for each target, in target order."""


@dataclass
class ClassReport:
    """A class's grade: a report per target graded, in target order. ``interrupted``: Ctrl-C
    stopped it; ``problem``: why it stopped early (the grader's or the class's files changed)."""

    targets: list[str]
    reports: list[GradeReport] = field(default_factory=list)
    interrupted: bool = False
    problem: str | None = None

    @property
    def complete(self) -> bool:
        return len(self.reports) == len(self.targets)

    @property
    def passed(self) -> bool:
        return self.complete and self.problem is None and all(r.passed for r in self.reports)

    @property
    def not_graded(self) -> list[str]:
        done = {r.target for r in self.reports}
        return [t for t in self.targets if t not in done]


@dataclass
class _Job:
    index: int
    target: str
    attempts: int = 0
    nonce: str = ""
    deadline: float = 0.0


class _Worker:
    """One worker process, its channel, and the job it grades."""

    def __init__(self, sealed_at: int | None) -> None:
        self.channel, theirs = socket.socketpair()
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        if sealed_at is not None:
            env[SEALED_ENV] = str(sealed_at)
        try:
            self.process = subprocess.Popen(
                start_command("maskln_cli.grading.worker", str(theirs.fileno())),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                env=env,
                start_new_session=True,  # Ctrl-C is this process's to handle, not the workers'
            )
        finally:
            theirs.close()
        self.job: _Job | None = None
        self.ready: dict[str, Any] | None = None
        self.buffer = b""

    def send(self, job: _Job, request: dict[str, Any], seconds: float) -> None:
        job.nonce = secrets.token_hex(16)
        job.deadline = time.monotonic() + seconds
        self.job = job
        message = {**request, "target": job.target, "job": job.nonce}
        with contextlib.suppress(OSError):  # it ended: its channel says so when read
            self.channel.sendall((json.dumps(message) + "\n").encode())

    def messages(self) -> list[dict[str, Any]] | None:
        """The messages come whole since last read; None when the worker ended (or sent what is
        not a JSON object)."""
        try:
            chunk = self.channel.recv(1 << 20)
        except OSError:
            chunk = b""
        if not chunk:
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        found = []
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:
                return None
            if not isinstance(message, dict):
                return None
            found.append(message)
        return found

    def answers(self, message: dict[str, Any]) -> bool:
        """Whether ``message`` is the answer to this worker's job (its nonce)."""
        nonce = message.get("job")
        return (
            self.job is not None
            and isinstance(nonce, str)
            and hmac.compare_digest(nonce.encode(), self.job.nonce.encode())
        )

    def stop(self) -> None:
        """SIGTERM (it kills its current child), then SIGKILL after a grace period."""
        with contextlib.suppress(OSError):
            self.channel.close()
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(GRACE_SECONDS + 2)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def grade_class(
    targets: Sequence[str],
    strict: bool = False,
    only: Sequence[str] = (),
    include: Sequence[str] = (),
    seed: int = 0,
    device: str = "cpu",
    timeout: float | None = None,
    jobs: int | None = None,
    memory_bytes: int | None = None,
    on_report: OnReport | None = None,
    recorded: Sequence[str] = (),
    op: str = "layer",
) -> ClassReport:
    """Grade each of ``targets`` (``path.py[:NAME]`` or ``package.module:NAME``) in a child
    process of its own, ``jobs`` at a time (default: the CPU count); the options are
    :func:`~maskln_cli.grading.runner.grade_target`'s. A target that cannot be graded at all
    (it cannot be imported) gets a failing report saying why. ``on_report`` is told each report
    in target order, as soon as it and those before it are done. ``recorded``: more files
    recorded with the class's (its rules file), whose change stops the class grade too.
    """
    if jobs is not None and jobs < 1:
        raise MasklnError(f"--jobs: must be at least 1, got {jobs}")
    chosen = select_clauses(only, strict, include, op)
    request = {
        "op": op,
        "strict": strict,
        "only": list(only),
        "include": list(include),
        "seed": seed,
        "device": device,
        "timeout": timeout,
        "memory_bytes": memory_bytes,
    }
    # A safety net only: the worker enforces each clause's limit itself.
    limit = timeout or CLAUSE_LIMIT
    budget = WORKER_START + len(chosen.run) * (limit + 2 * GRACE_SECONDS + 1)
    result = ClassReport(list(targets))
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(targets)))
    with protected_grader(contain=True):
        classroom = _Classroom(result, request, budget, jobs, on_report, recorded)
        try:
            classroom.run()
        except KeyboardInterrupt:
            result.interrupted = True
        finally:
            classroom.close()
    return result


def class_files(targets: Iterable[str]) -> list[str]:
    """The submissions' own files: each file target, and every ``*.py`` beside it."""
    found: set[str] = set()
    for target in targets:
        location = target.rpartition(":")[0] if ":" in target else target
        if os.path.isfile(location):
            path = os.path.abspath(location)
            found.add(path)
            folder = os.path.dirname(path)
            with contextlib.suppress(OSError):
                found.update(
                    entry.path for entry in os.scandir(folder) if entry.name.endswith(".py")
                )
    return sorted(found)


class _Classroom:
    """The class grade's loop: workers started, targets sent, answers checked (see the module
    docstring)."""

    def __init__(
        self,
        result: ClassReport,
        request: dict[str, Any],
        budget: float,
        jobs: int,
        on_report: OnReport | None,
        recorded: Sequence[str] = (),
    ) -> None:
        self.result, self.request, self.budget, self.jobs = result, request, budget, jobs
        self.on_report = on_report
        self.sealed_at: int | None = None  # once the first workers are ready: no submission ran
        self.spare = children()  # this process's own, before the class: not ours to kill
        self.pending = collections.deque(_Job(i, t) for i, t in enumerate(result.targets))
        self.done: dict[int, GradeReport] = {}
        self.workers: list[_Worker] = []
        self.grader_files: guard.Snapshot | None = None
        self.submissions = guard.Snapshot([*class_files(result.targets), *recorded])
        self.watched = guard.Watch(guard.watched_folders(result.targets))

    def run(self) -> None:
        self.start_workers()
        while len(self.result.reports) < len(self.result.targets) and not self.result.problem:
            busy = [w for w in self.workers if w.job is not None]
            if len(self.workers) < self.jobs and self.pending and not busy:
                self.start_workers()  # lost ones replaced, while no submission runs
                continue
            if len(self.workers) == self.jobs:
                for worker in self.workers:
                    if worker.job is None and self.pending:
                        worker.send(self.pending.popleft(), self.request, self.budget)
            if not any(w.job is not None for w in self.workers):
                break
            readable, _, _ = select.select([w.channel for w in self.workers], [], [], 1.0)
            before = (len(self.done), len(self.workers))
            for worker in list(self.workers):
                if worker.job is not None:
                    self.collect(worker, worker.channel in readable)
                elif worker.channel in readable:  # idle: it ended, or speaks unasked
                    self.lose(worker, "its worker answered unasked")
            if (len(self.done), len(self.workers)) != before:  # an answer, or a worker lost
                self.check_files()  # before any report is given out: a changed file voids it
            self.report_in_order()

    def collect(self, worker: _Worker, readable: bool) -> None:
        """Take the worker's answer, if it came; replace the worker if it is lost."""
        job = worker.job
        assert job is not None
        messages = worker.messages() if readable else []
        if messages is None:
            return self.lose(worker, "its worker process ended")
        for message in messages:
            if not worker.answers(message):
                return self.lose(worker, "its worker answered out of turn")
            worker.job = None
            self.done[job.index] = _report(job.target, self.request, message)
            if message.get("tampered"):
                self.result.problem = str(guard.Tampered(message["tampered"]))
            return None
        if time.monotonic() >= job.deadline:
            return self.lose(worker, "its worker did not finish in time")
        return None

    def lose(self, worker: _Worker, why: str) -> None:
        """A worker lost: stopped, its job graded again on a fresh worker, or a grader error
        when it was its last attempt; what it left behind killed."""
        job = worker.job
        worker.stop()
        self.workers.remove(worker)
        # Its children died with it (PR_SET_PDEATHSIG); what they detached came back here.
        kill_descendants(spare={*self.spare, *(w.process.pid for w in self.workers)})
        remove_folders_of(worker.process.pid)  # what it had no time to remove
        if job is None:
            return
        job.attempts += 1
        if job.attempts < ATTEMPTS:
            self.pending.appendleft(job)
            return
        problem = (
            f"grader error: {why} while grading it, {ATTEMPTS} times (killed?); not graded,"
            " no verdict"
        )
        seed = int(self.request.get("seed") or 0)
        strict = bool(self.request.get("strict"))
        self.done[job.index] = GradeReport(job.target, strict, [], seed, problem=problem)

    def start_workers(self) -> None:
        """Start workers up to ``jobs``, with no submission running: every process left under
        this one but the idle workers is killed first, and the files workers load checked; wait
        until each is ready (and not dumpable) before any target is sent."""
        kill_descendants(spare=self.spare, keep={w.process.pid for w in self.workers})
        if self.grader_files is not None:
            self.check_files()
            if self.result.problem is not None:
                return
        fresh = [_Worker(self.sealed_at) for _ in range(self.jobs - len(self.workers))]
        self.workers += fresh
        end = time.monotonic() + WORKER_START
        waiting = list(fresh)
        while waiting:
            remaining = end - time.monotonic()
            readable, _, _ = select.select([w.channel for w in waiting], [], [], max(0, remaining))
            if not readable:
                self.result.problem = (
                    f"grader error: its workers did not start within {WORKER_START:g} s"
                )
                return
            for worker in [w for w in waiting if w.channel in readable]:
                messages = worker.messages()
                if messages is None or (messages and messages[0].get("ready") is not True):
                    self.result.problem = "grader error: a worker ended while it started"
                    return
                if messages:
                    worker.ready = messages[0]
                    waiting.remove(worker)
        self.record_grader_files(fresh)
        if self.sealed_at is None:
            self.sealed_at = time.time_ns()

    def record_grader_files(self, fresh: list[_Worker]) -> None:
        """The first workers' files, recorded (they sealed themselves when ready: what they
        built or wrote before, their native kernels say, is theirs); a fresh worker's, checked
        against them, and sealed from the moment the first ones were ready."""
        paths = []
        for worker in fresh:
            ready = worker.ready or {}
            paths += [str(p) for p in (ready.get("files") or []) + (ready.get("folders") or [])]
        if self.grader_files is None:
            self.grader_files = guard.Snapshot(paths)
            return
        new = [p for p in paths if p not in self.grader_files.identities]
        changed = [p for p in new if _changed_since(p, self.sealed_at or 0)]
        if changed:
            self.result.problem = str(guard.Tampered(changed))
        self.grader_files.add(new)

    def check_files(self) -> None:
        """Stop the class (``problem``) when the grader's files or the class's changed."""
        if self.result.problem is not None:
            return
        changed = guard.tampered() or (self.grader_files.changed() if self.grader_files else [])
        if changed:
            self.result.problem = str(guard.Tampered(changed))
            return
        changed = self.submissions.changed()
        if changed:
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            shown = ", ".join(changed[:3]) + more
            self.result.problem = (
                f"the class's files changed while it was graded ({shown}): a submission may"
                " have changed another's; no verdict of this run can be trusted"
            )
            return
        planted = self.watched.changed()
        if planted:
            self.result.problem = guard.planted_words(planted)

    def report_in_order(self) -> None:
        while len(self.result.reports) in self.done and self.result.problem is None:
            report = self.done.pop(len(self.result.reports))
            self.result.reports.append(report)
            if self.on_report is not None:
                self.on_report(report, len(self.result.reports), len(self.result.targets))

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        kill_descendants(spare=self.spare)
        for worker in self.workers:  # one killed after its grace period left its folder
            remove_folders_of(worker.process.pid)


def _changed_since(path: str, moment: int) -> bool:
    """Whether ``path`` (or the link itself) changed, or appeared, at or after ``moment``."""
    for status in (os.stat, os.lstat):
        try:
            if status(path).st_ctime_ns >= moment:
                return True
        except OSError:
            continue
    return False


def _report(target: str, request: dict[str, Any], answer: dict[str, Any]) -> GradeReport:
    """A target's report from its worker's answer; a failing one saying why when there is none
    (the target could not be graded)."""
    strict = bool(request.get("strict"))
    problem = "the grader's worker sent a malformed report"
    if isinstance(answer.get("report"), dict):
        try:
            report = GradeReport.from_dict(answer["report"])
        except (KeyError, TypeError, ValueError):
            report = None
        if report is not None and report.target == target:
            return report
    elif answer.get("error"):
        problem = str(answer["error"])
    return GradeReport(target, strict, [], int(request.get("seed") or 0), problem=problem,
                       op=str(request.get("op") or "layer"))  # fmt: skip


def clause_names(reports: Sequence[GradeReport]) -> list[str]:
    """The clauses any report graded, in table order (the columns of a class's table)."""
    graded = {c.name for r in reports for c in r.clauses}
    return [name for name in CLAUSE_LEVELS if name in graded]
