"""Grade any implementation of masked layer normalization against its whole contract.

The contract is a list of clauses (:data:`~maskln_cli.clauses.CLAUSES`), each a property from
the specification (required) or one of maskln's own stronger guarantees (strict), with
deterministic cases, a *run* that calls the function and a *judge* that compares what came
back with the float64 reference and names the likely mistake (:mod:`maskln_cli.clauses`).
This module grades a function clause by clause into a plain-data :class:`GradeReport`.

Two ways in:

- :func:`grade` calls a function in this process: a one-line check for a test suite
  (:func:`assert_conforms`). A crash or a hang is this process's.
- :func:`grade_target` grades ``path/to/solution.py[:NAME]`` or ``package.module:NAME`` in a
  child process (:mod:`maskln_cli.sandbox`): a crash, a hang or an allocation beyond a memory
  cap fails the clause it happened in, and the child sends back only tensors (safetensors
  bytes) and plain JSON, judged here. ``maskln grade`` is this.

Example:
    >>> from maskln_cli import masked_layer_normalization
    >>> report = grade(masked_layer_normalization, only=["worked_example", "values"])
    >>> report.passed, [c.name for c in report.clauses]
    (True, ['worked_example', 'values'])
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import math
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from maskln_cli.clauses import (
    CLAUSES,
    Case,
    Clause,
    ClauseRun,
    Misbehaved,
    Verdict,
    describe_exception,
    run_clause,
)
from maskln_cli.errors import MasklnError

__all__ = [
    "CLAUSES",
    "DEFAULT_SEED",
    "DEFAULT_TIMEOUT",
    "ClauseResult",
    "GradeReport",
    "assert_conforms",
    "grade",
    "grade_target",
    "load_target",
    "run_clause",
]

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
    results = []
    for clause in select_clauses(only):
        started = time.perf_counter()
        cases = clause.build(seed)
        run = run_clause(fn, clause.name, seed, device, cases)
        results.append(
            judge_clause(
                clause,
                cases,
                run,
                device,
                _counted(clause, strict, only),
                time.perf_counter() - started,
            )
        )
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
    child process, clause by clause: see :mod:`maskln_cli.sandbox`.

    ``contain_processes``: this process does nothing else meanwhile (the command): it becomes
    a child subreaper for the grade, so processes the function detaches (a double fork,
    setsid) come back to it and are killed with the child; its other children are spared.

    Raises MasklnError (a usage error) when the target cannot be found, imported or called.
    """
    from maskln_cli import sandbox

    only = list(only)
    clauses = select_clauses(only)
    if not (timeout > 0 and math.isfinite(timeout)):
        raise MasklnError(f"--timeout: must be a positive number of seconds, got {timeout}")
    device = check_device(device)
    parse_target(target)  # a missing file is a usage error before anything starts
    results = []
    with sandbox.Sandbox(target, device, timeout, memory_bytes, contain_processes) as child:
        child.start()  # raises MasklnError when the target cannot be loaded
        for clause in clauses:
            started = time.perf_counter()
            cases = clause.build(seed)
            run = child.run_clause(clause.name, seed)
            results.append(
                judge_clause(
                    clause,
                    cases,
                    run,
                    device,
                    _counted(clause, strict, only),
                    time.perf_counter() - started,
                )
            )
    return GradeReport(target, strict, results, seed, device)


# --- targets -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where the function is: a file (``path``) or a module (``module``), and its name."""

    path: Path | None
    module: str | None
    name: str

    def __str__(self) -> str:
        where = str(self.path) if self.path is not None else self.module
        return f"{where}:{self.name}"


def parse_target(target: str) -> Target:
    """``solution.py``, ``solution.py:NAME`` or ``package.module:NAME``, checked.

    Example:
        >>> parse_target("maskln_cli:masked_layer_normalization")
        Target(path=None, module='maskln_cli', name='masked_layer_normalization')
    """
    location, _, name = target.rpartition(":") if ":" in target else (target, "", "")
    name = name or DEFAULT_FUNCTION_NAME
    if not location:
        raise MasklnError(f"TARGET {target!r}: expected FILE.py[:NAME] or package.module:NAME")
    if not name.isidentifier():
        raise MasklnError(f"TARGET {target}: {name!r} is not a Python name")
    looks_like_file = location.endswith(".py") or "/" in location or Path(location).is_file()
    if looks_like_file:
        path = Path(location)
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "no such file"
            raise MasklnError(f"TARGET {location}: {what}")
        return Target(path, None, name)
    if not all(part.isidentifier() for part in location.split(".")):
        raise MasklnError(f"TARGET {location}: neither a file nor a module name")
    return Target(None, location, name)


def is_maskln_target(target: str) -> bool:
    """Whether ``target`` is one of maskln's own functions: a module of the maskln_cli package
    (``maskln_cli:masked_layer_normalization``) or a file in it. A file elsewhere that imports
    maskln's op is not: it uses a ready-made implementation (``raw_ops`` fails it).

    Example:
        >>> is_maskln_target("maskln_cli:masked_layer_normalization")
        True
        >>> is_maskln_target("maskln_clipper.ops:f")
        False
    """
    parsed = parse_target(target)
    if parsed.module is not None:
        return parsed.module == "maskln_cli" or parsed.module.startswith("maskln_cli.")
    assert parsed.path is not None
    return parsed.path.resolve().parent == Path(__file__).resolve().parent


def load_target(target: str) -> Fn:
    """Import the target and return its function. Raises MasklnError naming the target, with
    the exception's last line, when it cannot be imported, or is missing or not callable.

    Example:
        >>> load_target("maskln_cli:masked_layer_normalization").__name__
        'masked_layer_normalization'
    """
    parsed = parse_target(target)
    try:
        if parsed.path is not None:
            module = _import_file(parsed.path)
        else:
            module = importlib.import_module(parsed.module or "")
    except MasklnError:
        raise
    except BaseException as error:  # SystemExit from a script's top level, too
        if isinstance(error, KeyboardInterrupt):
            raise
        where = parsed.path if parsed.path is not None else parsed.module
        line = _failing_line(error, parsed.path)
        raise MasklnError(
            f"TARGET {where}{line}: cannot import: {describe_exception(error)}"
        ) from None
    try:
        fn = getattr(module, parsed.name)
    except AttributeError:
        close = difflib.get_close_matches(
            parsed.name, [name for name, value in vars(module).items() if callable(value)], 1
        )
        where = parsed.path if parsed.path is not None else parsed.module
        hint = f"; did you mean {close[0]!r}? (TARGET {where}:{close[0]})" if close else ""
        raise MasklnError(f"TARGET {target}: no {parsed.name!r} in it{hint}") from None
    if not callable(fn):
        raise MasklnError(
            f"TARGET {target}: {parsed.name} is not callable (its type is {type(fn).__name__})"
        )
    return fn


def _failing_line(error: BaseException, path: Path | None) -> str:
    """``:LINE`` of the target file where importing it failed (a SyntaxError's own line, else
    the traceback's last frame in the file), or ``""``.

    Example:
        >>> try:
        ...     compile("def f(:", "t.py", "exec")
        ... except SyntaxError as error:
        ...     _failing_line(error, Path("t.py"))
        ':1'
    """
    if path is None:
        return ""
    if isinstance(error, SyntaxError) and error.filename and error.lineno:
        same = Path(error.filename).resolve() == path.resolve()
        return f":{error.lineno}" if same else ""
    lines = [
        frame.lineno
        for frame in traceback.extract_tb(error.__traceback__)
        if frame.filename and Path(frame.filename).resolve() == path.resolve()
    ]
    return f":{lines[-1]}" if lines else ""


def _import_file(path: Path) -> Any:
    """Import a file as a module of its own name-space (``torch.py`` shadows nothing)."""
    name = f"_maskln_graded_{zlib.crc32(str(path.resolve()).encode()):08x}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise MasklnError(f"TARGET {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # as Python does for a script: it may import its neighbours
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
