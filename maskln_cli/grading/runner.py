"""Grade any implementation of masked layer normalization against its whole contract.

The contract is a list of clauses (:data:`~maskln_cli.grading.clauses.CLAUSES`), each a
property from the specification (required) or one of maskln's own stronger guarantees (strict), with
deterministic cases, a *run* that calls the function and a *judge* that compares what came
back with the float64 reference and names the likely mistake (:mod:`maskln_cli.grading.clauses`).
This module grades a function clause by clause into a plain-data :class:`GradeReport`.

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

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from maskln_cli.errors import MasklnError
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
from maskln_cli.grading.targets import parse_target

DEFAULT_SEED = 0
DEFAULT_TIMEOUT = 60.0
"""Seconds each clause may take in the child process."""
DEFAULT_FUNCTION_NAME = "masked_layer_normalization"

Fn = Callable[..., Any]


# --- reports --------------------------------------------------------------------------------------


@dataclass
class ClauseResult:
    """A clause's verdict. ``detail``: the first counterexample or the reason it could not
    run, in one line (None when it passed). ``diagnosis``: the known mistakes the failure
    matches (an empty list: none matches; None: not a failure known mistakes explain)."""

    name: str
    required: bool
    passed: bool
    seconds: float
    detail: str | None = None
    diagnosis: list[dict[str, Any]] | None = None
    counted: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "required": self.required,
            "passed": self.passed,
            "seconds": round(self.seconds, 3),
            "detail": self.detail,
            "diagnosis": self.diagnosis,
        }


NO_MATCH = "matches none of the known mistakes"


@dataclass
class GradeReport:
    """The whole grade, as plain data: :meth:`to_dict` is ``maskln grade --json``."""

    target: str
    strict: bool
    clauses: list[ClauseResult]
    seed: int = DEFAULT_SEED
    device: str = "cpu"

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.clauses if c.counted)

    @property
    def diagnosis(self) -> list[dict[str, Any]]:
        """Every failing clause's diagnosis, with the clause's name; a clause whose failure
        matches no known mistake says so."""
        found = []
        for clause in self.clauses:
            if clause.passed or clause.diagnosis is None:
                continue
            if not clause.diagnosis:
                found.append(
                    {
                        "clause": clause.name,
                        "mistake": None,
                        "description": NO_MATCH,
                        "fix": None,
                        "distance": None,
                    }
                )
            for diagnosis in clause.diagnosis:
                found.append({"clause": clause.name, **diagnosis})
        return found

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "target": self.target,
            "strict": self.strict,
            "clauses": [c.to_dict() for c in self.clauses],
            "diagnosis": self.diagnosis,
        }

    def verdict(self) -> str:
        """``PASS: 14 of 14 required clauses pass`` or ``FAIL: ... (names)``; strict clauses
        are counted with ``strict`` (or when named with ``only``), else mentioned.

        Example:
            >>> report = GradeReport("f", False, [ClauseResult("values", True, False, 0.1),
            ...                                   ClauseResult("signature", True, True, 0.1)])
            >>> report.verdict()
            'FAIL: 1 of 2 required clauses pass (values)'
        """
        counted = [c for c in self.clauses if c.counted]
        failed = [c.name for c in counted if not c.passed]
        if any(not c.required for c in counted):
            kind = "clauses, strict included," if self.strict else "clauses"
        else:
            kind = "required clauses"
        line = f"{len(counted) - len(failed)} of {len(counted)} {kind} pass"
        line = f"{'PASS' if not failed else 'FAIL'}: {line}"
        if failed:
            line += f" ({', '.join(failed)})"
        uncounted = [c for c in self.clauses if not c.counted]
        if uncounted:
            failing = [c.name for c in uncounted if not c.passed]
            strict = f"; strict: {len(uncounted) - len(failing)} of {len(uncounted)}"
            line += strict + (f" ({', '.join(failing)})" if failing else "")
        return line

    def text(self) -> str:
        """The report as plain text (for :func:`assert_conforms` and logs)."""
        lines = [f"maskln grade {self.target} (seed {self.seed}, device {self.device})"]
        width = max((len(c.name) for c in self.clauses), default=0)
        for c in self.clauses:
            verdict = "PASS" if c.passed else "FAIL"
            level = "required" if c.required else "strict"
            lines.append(f"  {verdict}  {c.name:<{width}}  {level:<8}  {c.seconds:6.2f} s")
            if c.detail:
                lines.append(f"        {c.detail}")
        if self.diagnosis:
            lines.append("diagnosis")
            lines += [f"  {line}" for line in diagnosis_lines(self)]
        lines.append(self.verdict())
        return "\n".join(lines)


def diagnosis_lines(report: GradeReport) -> list[str]:
    """One line per diagnosis: ``values: likely unbiased variance ...; use ...``."""
    lines = []
    for found in report.diagnosis:
        if found["mistake"] is None:
            lines.append(f"{found['clause']}: the result {NO_MATCH}")
        else:
            lines.append(f"{found['clause']}: likely {found['description']}; {found['fix']}")
    return lines


# --- grading -----------------------------------------------------------------------------------


def select_clauses(only: Iterable[str] = ()) -> list[Clause]:
    """The clauses to grade, in table order: all, or those named (checked)."""
    names = list(dict.fromkeys(only))
    unknown = [n for n in names if n not in CLAUSES]
    if unknown:
        raise MasklnError(f"--only: no clause {unknown[0]!r}; the clauses are {', '.join(CLAUSES)}")
    return [c for c in CLAUSES.values() if not names or c.name in names]


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
) -> ClauseResult:
    """The verdict of a clause from what its run gave (any surprise in that data, say from a
    misbehaving child, fails the clause rather than the grader)."""
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
    return ClauseResult(
        clause.name,
        clause.required,
        verdict.passed,
        seconds + time.perf_counter() - started,
        verdict.detail if not verdict.passed else None,
        diagnosis,
        counted,
    )


def _counted(clause: Clause, strict: bool, only: Sequence[str]) -> bool:
    return clause.required or strict or clause.name in only


def _grade_each(
    clauses: Iterable[Clause],
    run: Callable[[Clause, list[Case]], ClauseRun],
    strict: bool,
    only: Sequence[str],
    seed: int,
    device: str,
) -> list[ClauseResult]:
    """Build, run and judge each clause in turn; ``run(clause, cases)`` calls the function
    (in this process, or in the child)."""
    results = []
    for clause in clauses:
        started = time.perf_counter()
        cases = clause.build(seed)
        clause_run = run(clause, cases)
        results.append(
            judge_clause(
                clause,
                cases,
                clause_run,
                device,
                _counted(clause, strict, only),
                time.perf_counter() - started,
            )
        )
    return results


def grade(
    fn: Fn,
    strict: bool = False,
    only: Iterable[str] = (),
    seed: int = DEFAULT_SEED,
    device: str = "cpu",
    target: str | None = None,
) -> GradeReport:
    """Grade ``fn`` in this process; returns the report as plain data.

    ``strict``: strict clauses count toward ``passed`` (they are reported either way).
    ``only``: grade these clauses (each counts). An exception in ``fn`` fails the clause it
    happened in; a crash or hang is this process's (``grade_target`` isolates those).

    Example:
        >>> def rms_instead(x, valid, scale, bias, eps=1e-5):
        ...     y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * scale + bias
        ...     return torch.where(valid[..., None], y, 0.0)
        >>> report = grade(rms_instead, only=["values"])
        >>> report.passed, report.diagnosis[0]["mistake"]
        (False, 'rms_norm')
    """
    only = list(only)
    device = check_device(device)

    def run_here(clause: Clause, cases: list[Case]) -> ClauseRun:
        return run_clause(fn, clause.name, seed, device, cases)

    results = _grade_each(select_clauses(only), run_here, strict, only, seed, device)
    name = target or getattr(fn, "__qualname__", None) or repr(fn)
    return GradeReport(name, strict, results, seed, device)


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
    timeout: float = DEFAULT_TIMEOUT,
    memory_bytes: int | None = None,
    contain_processes: bool = False,
) -> GradeReport:
    """Grade ``target`` (``path/to/solution.py[:NAME]`` or ``package.module:NAME``) in a
    child process, clause by clause: see :mod:`maskln_cli.grading.sandbox`.

    ``contain_processes``: this process does nothing else meanwhile (the command): it becomes
    a child subreaper for the grade, so processes the function detaches (a double fork,
    setsid) come back to it and are killed with the child; its other children are spared.

    Raises MasklnError (a usage error) when the target cannot be found, imported or called.
    """
    from maskln_cli.grading import sandbox

    only = list(only)
    clauses = select_clauses(only)
    if not (timeout > 0 and math.isfinite(timeout)):
        raise MasklnError(f"--timeout: must be a positive number of seconds, got {timeout}")
    device = check_device(device)
    parse_target(target)  # a missing file is a usage error before anything starts
    with sandbox.Sandbox(target, device, timeout, memory_bytes, contain_processes) as child:
        child.start()  # raises MasklnError when the target cannot be loaded

        def run_in_child(clause: Clause, cases: list[Case]) -> ClauseRun:
            return child.run_clause(clause.name, seed)  # the child builds the same cases

        results = _grade_each(clauses, run_in_child, strict, only, seed, device)
    return GradeReport(target, strict, results, seed, device)
