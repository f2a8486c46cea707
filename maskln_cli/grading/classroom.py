"""Grading a whole class: many targets, each in a child process of its own, several at a time.

:func:`grade_class` starts ``jobs`` worker processes (:mod:`.worker`), hands each the next target
as it becomes free, and collects the reports in target order. A submission that hangs or crashes
costs only its own time (its clauses' time limits; its worker kills its child); one that kills its
worker costs only its own grade (FAIL, said so) and a new worker takes the next target. Ctrl-C
stops every worker, and their children, and returns what was graded so far. This module imports
no torch: the grading happens in the workers.

This process is a child subreaper meanwhile, so that nothing a submission started outlives the
class grade, and not dumpable (:mod:`.processes`). When files the grader loads changed while a
submission ran (:mod:`.guard`), no later verdict can be trusted: the class grade stops there.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from maskln_cli.grading import guard
from maskln_cli.grading.processes import (
    GRACE_SECONDS,
    children,
    kill_descendants,
    protected_grader,
)
from maskln_cli.grading.report import GradeReport
from maskln_cli.grading.selection import CLAUSE_LEVELS
from maskln_cli.grading.selection import select as select_clauses
from maskln_cli.grading.worker import PARENT_ENV

WORKER_START = 120.0
"""Seconds a worker may take beyond its clauses' time limits for one target (Python, torch and
the grader imported twice, in it and in the target's child)."""

OnReport = Callable[[GradeReport, int, int], None]
"""Told ``(report, graded, total)`` for each target, in target order."""


@dataclass
class ClassReport:
    """A class's grade: a report per target graded, in target order. ``interrupted``: Ctrl-C
    stopped it; ``problem``: why it stopped early (the grader's files changed)."""

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


class _Worker:
    """One worker process, and the target it grades (index, target, deadline)."""

    def __init__(self) -> None:
        package_root = str(Path(__file__).resolve().parent.parent.parent)
        path = os.environ.get("PYTHONPATH")
        env = {
            **os.environ,
            "PYTHONPATH": package_root + (os.pathsep + path if path else ""),
            PARENT_ENV: str(os.getpid()),
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "maskln_cli.grading.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # Ctrl-C is this process's to handle, not the workers'
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.requests: IO[bytes] = self.process.stdin
        self.answers: IO[bytes] = self.process.stdout
        self.task: tuple[int, str, float] | None = None
        self.buffer = b""

    def send(self, index: int, target: str, request: dict[str, Any], seconds: float) -> None:
        self.task = (index, target, time.monotonic() + seconds)
        self.requests.write((json.dumps({**request, "target": target}) + "\n").encode())
        self.requests.flush()

    def read(self) -> dict[str, Any] | None:
        """The answer, once a whole line has come; {} when the worker ended instead."""
        chunk = os.read(self.answers.fileno(), 1 << 20)
        if not chunk:
            return {}
        self.buffer += chunk
        line, newline, rest = self.buffer.partition(b"\n")
        if not newline:
            return None
        self.buffer = rest
        try:
            answer = json.loads(line)
        except ValueError:
            return {"error": "the grader's worker sent a malformed answer"}
        return answer if isinstance(answer, dict) else {}

    def stop(self) -> None:
        """SIGTERM (it kills its current child), then SIGKILL after a grace period."""
        for stream in (self.requests, self.answers):
            with contextlib.suppress(OSError):
                stream.close()
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
    timeout: float = 60.0,
    jobs: int | None = None,
    memory_bytes: int | None = None,
    on_report: OnReport | None = None,
) -> ClassReport:
    """Grade each of ``targets`` (``path.py[:NAME]`` or ``package.module:NAME``) in a child
    process of its own, ``jobs`` at a time (default: the CPU count); the options are
    :func:`~maskln_cli.grading.runner.grade_target`'s. A target that cannot be graded at all
    (it cannot be imported) gets a failing report saying why. ``on_report`` is told each report
    in target order, as soon as it and those before it are done.
    """
    chosen = select_clauses(only, strict, include)
    request = {
        "strict": strict,
        "only": list(only),
        "include": list(include),
        "seed": seed,
        "device": device,
        "timeout": timeout,
        "memory_bytes": memory_bytes,
    }
    # A safety net only: the worker enforces each clause's limit itself.
    budget = WORKER_START + len(chosen.run) * (timeout + 2 * GRACE_SECONDS + 1)
    result = ClassReport(list(targets))
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(targets)))
    with protected_grader(contain=True):
        spare = children()
        workers: list[_Worker] = []
        try:
            _run(result, request, budget, jobs, workers, on_report)
        except KeyboardInterrupt:
            result.interrupted = True
        finally:
            for worker in workers:
                worker.stop()
            kill_descendants(spare=spare)
    return result


def _run(
    result: ClassReport,
    request: dict[str, Any],
    budget: float,
    jobs: int,
    workers: list[_Worker],
    on_report: OnReport | None,
) -> None:
    pending = collections.deque(enumerate(result.targets))
    done: dict[int, GradeReport] = {}
    while len(result.reports) < len(result.targets):
        while len(workers) < jobs and pending:
            workers.append(_Worker())
        for worker in workers:
            if worker.task is None and pending:
                index, target = pending.popleft()
                worker.send(index, target, request, budget)
        busy = [w for w in workers if w.task is not None]
        if not busy:
            break
        readable, _, _ = select.select([w.answers for w in busy], [], [], 1.0)
        for worker in busy:
            assert worker.task is not None
            index, target, deadline = worker.task
            answer = worker.read() if worker.answers in readable else None
            if answer is None and time.monotonic() < deadline:
                continue
            report = _report(target, request, answer)
            done[index] = report
            if answer is None or not answer or ("report" not in answer and "error" not in answer):
                worker.stop()  # timed out or gone: a new one takes the next target
                workers.remove(worker)
            else:
                worker.task = None
            if answer and answer.get("tampered"):
                result.problem = str(guard.Tampered(answer["tampered"]))
        while len(result.reports) in done:
            report = done.pop(len(result.reports))
            result.reports.append(report)
            if on_report is not None:
                on_report(report, len(result.reports), len(result.targets))
        changed = guard.tampered()
        if changed:
            result.problem = str(guard.Tampered(changed))
        if result.problem is not None:
            return


def _report(target: str, request: dict[str, Any], answer: dict[str, Any] | None) -> GradeReport:
    """A target's report from its worker's answer; a failing one saying why when there is none
    (the target could not be graded, its worker ended, or it ran out of time)."""
    strict = bool(request.get("strict"))
    if answer and isinstance(answer.get("report"), dict):
        try:
            return GradeReport.from_dict(answer["report"])
        except (KeyError, TypeError, ValueError):
            problem = "the grader's worker sent a malformed report"
    elif answer and answer.get("error"):
        problem = str(answer["error"])
    elif answer is None:
        problem = "grading it did not finish in time (its worker was stopped)"
    else:
        problem = "the grader's worker process ended while grading it (killed by the submission?)"
    return GradeReport(target, strict, [], int(request.get("seed") or 0), problem=problem)


def clause_names(reports: Sequence[GradeReport]) -> list[str]:
    """The clauses any report graded, in table order (the columns of a class's table)."""
    graded = {c.name for r in reports for c in r.clauses}
    return [name for name in CLAUSE_LEVELS if name in graded]
