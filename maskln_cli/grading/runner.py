"""Grade any implementation of masked layer normalization against its whole contract.

The contract is a list of clauses (:data:`~maskln_cli.grading.clauses.CLAUSES`), each a
property from the specification (required), one of maskln's own stronger guarantees (strict), or
beyond the specification and graded only when asked for (optional: half precision), with
deterministic cases, a *run* that calls the function and a *judge* that compares what came
back with the float64 reference and names the likely mistake (:mod:`maskln_cli.grading.clauses`).
This module grades a function clause by clause into a plain-data :class:`GradeReport`
(:mod:`maskln_cli.grading.report`), led by the root cause of its failures
(:mod:`maskln_cli.grading.rootcause`); which clauses run and count is
:mod:`maskln_cli.grading.selection`'s.

Two ways in:

- :func:`grade` calls a function in this process: a one-line check for a test suite
  (:func:`assert_conforms`). A crash or a hang is this process's.
- :func:`grade_target` grades ``path/to/solution.py[:NAME]`` or ``package.module:NAME`` in a
  child process (:mod:`maskln_cli.grading.sandbox`): a crash, a hang or an allocation beyond a
  memory cap fails the clause it happened in, and the child sends back only tensors (safetensors
  bytes) and plain JSON, judged here. ``maskln grade`` is this.

Example:
    >>> from maskln_cli import masked_layer_normalization
    >>> report = grade(masked_layer_normalization, only=["worked_example", "values"])
    >>> report.passed, [c.name for c in report.clauses]
    (True, ['worked_example', 'values'])
"""

from __future__ import annotations

import contextlib
import secrets
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from maskln_cli.errors import MasklnError
from maskln_cli.grading import guard
from maskln_cli.grading.clauses import (
    CLAUSES,
    Case,
    Clause,
    ClauseRun,
    Misbehaved,
    Verdict,
    describe_exception,
    run_clause,
)
from maskln_cli.grading.clauses.state import preserved_state
from maskln_cli.grading.confirm import (
    Outcome,
    Spec,
    build_probe,
    judge_probe,
    keeper,
    run_probe,
)
from maskln_cli.grading.exercise import exercising
from maskln_cli.grading.guard import Tampered
from maskln_cli.grading.report import (
    NO_MATCH,
    ClauseResult,
    GradeReport,
    RootCause,
    diagnosis_lines,
)
from maskln_cli.grading.rootcause import Confirm, Judged, find_root_cause, where_it_differs
from maskln_cli.grading.selection import Selection, check_timeout, select
from maskln_cli.grading.targets import parse_target

__all__ = [
    "CLAUSES",
    "DEFAULT_SEED",
    "DEFAULT_TIMEOUT",
    "NO_MATCH",
    "ClauseResult",
    "GradeReport",
    "RootCause",
    "assert_conforms",
    "diagnosis_lines",
    "grade",
    "grade_target",
    "run_clause",
]

DEFAULT_SEED = 0
DEFAULT_TIMEOUT: float | None = None
"""Seconds each clause may take in the child process (``--timeout``); by default None: each
call of the function has a limit of its own, a multiple of what maskln's op or a Python loop
over the rows takes on its case, at least a few seconds, and each clause a minute at most
(:mod:`maskln_cli.grading.child`)."""
DEFAULT_FUNCTION_NAME = "masked_layer_normalization"

Fn = Callable[..., Any]
Progress = Callable[[str, int, int], None]
"""Told ``(clause, index, total)`` as each clause starts (index from 0)."""


# --- grading -----------------------------------------------------------------------------------


def select_clauses(only: Iterable[str] = ()) -> list[Clause]:
    """The clauses :func:`grade` runs for ``only`` (checked), in table order."""
    return [CLAUSES[name] for name in select(only).run]


def check_device(device: str) -> str:
    """``device`` as the tensors built on it report theirs, when this torch can use it: ``cpu``
    for any ``cpu:N`` (one CPU device), ``cuda:N`` for ``cuda``; a usage error for a device type
    this build or machine does not have (``mps`` or ``xpu`` on a CPU-only build, ``meta``).

    Example:
        >>> check_device("cpu:1")
        'cpu'
    """
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise MasklnError(f"--device: not a device: {device!r} ({error})") from None
    if parsed.type == "cpu":
        return "cpu"
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise MasklnError(f"--device {device}: this torch has no CUDA device")
        index = torch.cuda.current_device() if parsed.index is None else parsed.index
        count = torch.cuda.device_count()
        if index >= count:
            raise MasklnError(f"--device {device}: this torch sees {count} CUDA device(s)")
        return f"cuda:{index}"
    if not _available(parsed.type):
        raise MasklnError(f"--device {device}: no {parsed.type} device is available to this torch")
    return str(parsed)


def _available(kind: str) -> bool:
    """Whether this torch can run on devices of type ``kind`` (``mps``, ``xpu``, a backend
    registered as ``torch.<kind>`` with ``is_available()``)."""
    if kind == "mps":
        return bool(torch.backends.mps.is_available())
    is_available = getattr(getattr(torch, kind, None), "is_available", None)
    try:
        return callable(is_available) and bool(is_available())
    except Exception:  # a backend's own check failing means it cannot be used
        return False


def judge_clause(
    clause: Clause, cases: list[Case], run: ClauseRun, device: str, counted: bool, seconds: float
) -> Judged:
    """The verdict of a clause from what its run gave (any surprise in that data, say from a
    misbehaving child, fails the clause rather than the grader), with its counterexample."""
    started = time.perf_counter()
    if run.failure is not None:
        verdict = Verdict(False, run.failure)
    else:
        run.device = device
        try:
            verdict = clause.judge(cases, run)
        except Misbehaved as error:
            verdict = Verdict(False, str(error))
        except (RuntimeError, TypeError, ValueError, KeyError, IndexError) as error:
            verdict = Verdict(
                False, f"the results could not be judged: {describe_exception(error)}"
            )
    diagnosis = None
    if not verdict.passed and verdict.diagnosis is not None:
        diagnosis = [d.to_dict() for d in verdict.diagnosis]
    result = ClauseResult(
        clause.name,
        clause.required,
        verdict.passed,
        seconds + time.perf_counter() - started,
        verdict.detail if not verdict.passed else None,
        diagnosis,
        counted,
        clause.level,
    )
    return Judged(clause, cases, run, result, verdict.case, verdict.call)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread while grading, as in the child: the cases are small, and a busy
    machine makes torch's thread pool spin (judging one clause took 9.4 s on two threads,
    0.37 s on one, at a load of 17 on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _grade_each(
    selection: Selection,
    run: Callable[[Clause, list[Case]], ClauseRun],
    seed: int,
    device: str,
    progress: Progress | None = None,
    judged: list[Judged] | None = None,
    confirm: Confirm | None = None,
) -> tuple[list[ClauseResult], RootCause | None, str | None]:
    """Build, run and judge each clause in turn (``run(clause, cases)`` calls the function, in
    this process or in the child), then find the failures' root cause (``confirm`` probes the
    suspected ones), or where they differ. ``judged`` receives each clause as it is judged
    (what was graded before an interruption)."""
    judged = [] if judged is None else judged
    with one_thread():
        _judge_each(selection, run, seed, device, progress, judged)
        root = find_root_cause(judged, confirm)
        differs = where_it_differs(judged) if root is None else None
    return [j.result for j in judged], root, differs


def confirm_in_process(fn: Fn, seed: int, device: str) -> Confirm:
    """Probe a suspected cause by calling ``fn`` in this process (:mod:`.confirm`)."""

    kept: list[Any] = []

    def confirm(mistake: str, judged: Judged) -> Outcome:
        index = judged.counterexample()
        if index is None:
            return Outcome(False)
        spec = Spec.of(judged.clause.name, judged.call, judged.result.detail)
        where = f"{judged.clause.name} {index} {secrets.randbelow(1 << 30)}"
        probe = build_probe(mistake, judged.cases[index], spec, seed, where)
        if probe is None:
            return Outcome(False)
        kept[:] = kept or keeper()
        with warnings.catch_warnings(), preserved_state():
            warnings.simplefilter("ignore")
            run = run_probe(fn, probe, device, kept)
        return judge_probe(probe, run)

    return confirm


def _judge_each(
    selection: Selection,
    run: Callable[[Clause, list[Case]], ClauseRun],
    seed: int,
    device: str,
    progress: Progress | None,
    judged: list[Judged],
) -> None:
    for index, name in enumerate(selection.run):
        if progress is not None:
            progress(name, index, len(selection.run))
        clause = CLAUSES[name]
        started = time.perf_counter()
        cases = clause.build(seed)
        clause_run = run(clause, cases)
        judged.append(
            judge_clause(
                clause,
                cases,
                clause_run,
                device,
                name in selection.counted,
                time.perf_counter() - started,
            )
        )


def grade(
    fn: Fn,
    strict: bool = False,
    only: Iterable[str] = (),
    seed: int = DEFAULT_SEED,
    device: str = "cpu",
    target: str | None = None,
    include: Iterable[str] = (),
    progress: Progress | None = None,
    op: str = "layer",
) -> GradeReport:
    """Grade ``fn`` in this process; returns the report as plain data.

    ``strict``: strict clauses count toward ``passed`` (they are reported either way), but for
    ``output_layout``, maskln's own convention. ``include``: clauses that count too, strict ones
    or optional ones (``half_values``, or the group ``half``), which run only when named.
    ``only``: grade these clauses (each counts). ``op``: the exercise, ``layer`` or ``rms``
    (``masked_rms_normalization(x, valid, scale, eps=1e-6)``: :mod:`.exercise`). An exception
    in ``fn`` fails the clause it happened in; a crash or hang is this process's
    (``grade_target`` isolates those).

    Example:
        >>> def rms_instead(x, valid, scale, bias, eps=1e-5):
        ...     y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * scale + bias
        ...     return torch.where(valid[..., None], y, 0.0)
        >>> report = grade(rms_instead, only=["values"])
        >>> report.passed, report.diagnosis[0]["mistake"]
        (False, 'rms_norm')
    """
    included = list(include)
    selection = select(only, strict, included, op)
    device = check_device(device)

    def run_here(clause: Clause, cases: list[Case]) -> ClauseRun:
        return run_clause(fn, clause.name, seed, device, cases)

    with exercising(op):
        confirm = confirm_in_process(fn, seed, device)
        results, root, differs = _grade_each(selection, run_here, seed, device, progress,
                                             confirm=confirm)  # fmt: skip
    name = target or getattr(fn, "__qualname__", None) or repr(fn)
    return GradeReport(name, strict, results, seed, device, root, included=included,
                       differs=differs, op=op)  # fmt: skip


def assert_conforms(fn: Fn, strict: bool = False, **options: Any) -> None:
    """Raise ``AssertionError`` with the report's text unless ``fn`` passes.

    Example:
        >>> from maskln_cli import masked_layer_normalization
        >>> assert_conforms(masked_layer_normalization, only=["worked_example"])
    """
    report = grade(fn, strict=strict, **options)
    if not report.passed:
        raise AssertionError(report.text())


def grade_target(
    target: str,
    strict: bool = False,
    only: Iterable[str] = (),
    seed: int = DEFAULT_SEED,
    device: str = "cpu",
    timeout: float | None = DEFAULT_TIMEOUT,
    memory_bytes: int | None = None,
    contain_processes: bool = False,
    include: Iterable[str] = (),
    progress: Progress | None = None,
    fork_child: bool = False,
    watch: bool = True,
    op: str = "layer",
) -> GradeReport:
    """Grade ``target`` (``path/to/solution.py[:NAME]`` or ``package.module:NAME``) in a
    child process, clause by clause: see :mod:`maskln_cli.grading.sandbox`.

    ``timeout``: seconds each clause may take (``--timeout``); None: each call of the function
    may take a multiple of what maskln's op or a Python loop over the rows takes on its case,
    at least a few seconds, and each
    clause a minute at most (:data:`~maskln_cli.grading.sandbox.CLAUSE_LIMIT`).
    ``contain_processes``: this process does nothing else meanwhile (the command): it becomes a
    child subreaper for the grade, so processes the function detaches (a double fork, setsid)
    come back to it and are killed with the child; its other children are spared.
    ``fork_child``: fork the child from this process, which must run no other thread (a class
    grade's worker), instead of starting a new interpreter. ``watch``: the folders a child
    imports from and rules are read from (the current folder, the target's, ``PYTHONPATH``'s)
    are watched, and a module or rules file that appears there while the function runs leaves
    the grade without a verdict (a class grade watches them itself). ``op``: the exercise
    (:mod:`.exercise`), which the child grades too (a file's function is found by its name,
    ``masked_rms_normalization`` for ``rms``).

    Raises MasklnError (a usage error) when the target cannot be found, imported or called.
    """
    included = list(include)
    selection = select(only, strict, included, op)
    if timeout is not None:
        check_timeout(timeout)
    device = check_device(device)
    with exercising(op):
        parse_target(target)  # a missing file is a usage error before anything starts
        return _grade_in_child(
            target,
            strict,
            selection,
            seed,
            device,
            timeout,
            memory_bytes,
            contain_processes,
            included,
            progress,
            fork_child,
            watch,
            op,
        )


def _grade_in_child(
    target: str,
    strict: bool,
    selection: Selection,
    seed: int,
    device: str,
    timeout: float | None,
    memory_bytes: int | None,
    contain_processes: bool,
    included: list[str],
    progress: Progress | None,
    fork_child: bool,
    watch: bool,
    op: str,
) -> GradeReport:
    """:func:`grade_target`'s grade, its options checked, under the exercise ``op``."""
    from maskln_cli.grading import sandbox

    fork_child = fork_child and device == "cpu"  # CUDA cannot be used again in a forked child
    judged: list[Judged] = []
    watched = guard.Watch(guard.watched_folders([target])) if watch else None
    try:
        with sandbox.Sandbox(
            target, device, timeout, memory_bytes, contain_processes, fork=fork_child, op=op
        ) as child:
            child.start()  # raises MasklnError when the target cannot be loaded

            def run_in_child(clause: Clause, cases: list[Case]) -> ClauseRun:
                return child.run_clause(clause.name, seed)  # the child builds the same cases

            with one_thread():
                _judge_each(selection, run_in_child, seed, device, progress, judged)
                root = find_root_cause(judged, confirm_in_child(child, seed))
                differs = where_it_differs(judged) if root is None else None
    except Tampered as tampered:  # the grader's own files changed: no verdict but FAIL
        results = [j.result for j in judged]
        return GradeReport(target, strict, results, seed, device, problem=str(tampered),
                           included=included, op=op)  # fmt: skip
    results = [j.result for j in judged]
    planted = watched.changed() if watched is not None else []
    if planted:
        return GradeReport(target, strict, results, seed, device,
                           problem=guard.planted_words(planted), included=included,
                           op=op)  # fmt: skip
    return GradeReport(target, strict, results, seed, device, root, included=included,
                       differs=differs, op=op)  # fmt: skip


def confirm_in_child(child: Any, seed: int) -> Confirm:
    """Probe a suspected cause by calling the function in the grader's child (``child``, a
    :class:`~maskln_cli.grading.sandbox.Sandbox`): it builds the same probe from the clause,
    the case and the mistake, and sends back what the calls gave; judged here."""
    from maskln_cli.grading import sandbox

    def confirm(mistake: str, judged: Judged) -> Outcome:
        index = judged.counterexample()
        if index is None:
            return Outcome(False)
        spec = Spec.of(judged.clause.name, judged.call, judged.result.detail)
        salt = secrets.randbelow(1 << 30)
        where = f"{judged.clause.name} {index} {salt}"
        probe = build_probe(mistake, judged.cases[index], spec, seed, where)
        if probe is None:
            return Outcome(False)
        run = sandbox.run_probe(child, judged.clause.name, seed, index, mistake, spec.to_dict(),
                                salt)  # fmt: skip
        if run is None:
            return Outcome(False)
        return judge_probe(probe, run)

    return confirm
