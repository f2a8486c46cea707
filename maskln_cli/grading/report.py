"""A grade as plain data: each clause's verdict (:class:`ClauseResult`), the whole report
(:class:`GradeReport`, whose ``to_dict`` is ``maskln grade --json``) and its root cause: the one
known mistake that explains the most failing clauses. No torch here: a class's reports come back
from worker processes as JSON and are rebuilt with :meth:`GradeReport.from_dict`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

NO_MATCH = "matches none of the known mistakes"

LEVEL_WORDS = {"required": "required", "strict": "strict", "optional": "half precision"}


@dataclass
class ClauseResult:
    """A clause's verdict. ``detail``: the first counterexample or the reason it could not
    run, in one line (None when it passed). ``diagnosis``: the known mistakes the failure
    matches (an empty list: none matches; None: not a failure known mistakes explain).
    ``counted``: whether it counts toward the verdict. ``cause``: the clause whose mistake (the
    report's root cause) this clause fails only through, when it is another clause."""

    name: str
    required: bool
    passed: bool
    seconds: float
    detail: str | None = None
    diagnosis: list[dict[str, Any]] | None = None
    counted: bool = True
    level: str = ""
    cause: str | None = None

    def __post_init__(self) -> None:
        if not self.level:
            self.level = "required" if self.required else "strict"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "level": self.level,
            "required": self.required,
            "counted": self.counted,
            "passed": self.passed,
            "seconds": round(self.seconds, 3),
            "detail": self.detail,
            "diagnosis": self.diagnosis,
            "cause": self.cause,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClauseResult:
        return cls(
            name=str(data["name"]),
            required=bool(data["required"]),
            passed=bool(data["passed"]),
            seconds=float(data["seconds"]),
            detail=data.get("detail"),
            diagnosis=data.get("diagnosis"),
            counted=bool(data.get("counted", True)),
            level=str(data.get("level") or ""),
            cause=data.get("cause"),
        )


@dataclass
class RootCause:
    """The known mistake that explains the most failing clauses: it is named in ``clause``'s
    diagnosis, and the clauses in ``explains`` (that one included) fail only through it."""

    mistake: str
    description: str
    fix: str
    clause: str
    explains: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # every field, in order; lists copied


@dataclass
class GradeReport:
    """The whole grade, as plain data: :meth:`to_dict` is ``maskln grade --json``.

    ``problem``: why the grade has no verdict at all (the submission tampered with the grader,
    or could not be graded); such a report fails. ``rules``: the rule set that graded it
    (:mod:`maskln_cli.grading.rules`), as shown, and ``rules_source`` where they come from
    (the file and a hash of it). ``differs``: where a failing grade with no confirmed cause
    differs, in words. ``op``: the exercise graded (``layer`` or ``rms``,
    :mod:`maskln_cli.grading.exercise`).
    """

    target: str
    strict: bool
    clauses: list[ClauseResult]
    seed: int = 0
    device: str = "cpu"
    root_cause: RootCause | None = None
    problem: str | None = None
    included: list[str] = field(default_factory=list)
    rules: str | None = None
    differs: str | None = None
    rules_source: str | None = None
    op: str = "layer"

    @property
    def passed(self) -> bool:
        return self.problem is None and all(c.passed for c in self.clauses if c.counted)

    @property
    def failed(self) -> list[str]:
        """The counted clauses that failed, in table order."""
        return [c.name for c in self.clauses if c.counted and not c.passed]

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
            "op": self.op,
            "strict": self.strict,
            "included": list(self.included),
            "rules": self.rules,
            "rules_source": self.rules_source,
            "seed": self.seed,
            "device": self.device,
            "problem": self.problem,
            "root_cause": self.root_cause.to_dict() if self.root_cause else None,
            "differs": self.differs,
            "failed": self.failed,
            "clauses": [c.to_dict() for c in self.clauses],
            "diagnosis": self.diagnosis,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GradeReport:
        cause = data.get("root_cause")
        return cls(
            target=str(data["target"]),
            strict=bool(data.get("strict")),
            clauses=[ClauseResult.from_dict(c) for c in data.get("clauses") or []],
            seed=int(data.get("seed") or 0),
            device=str(data.get("device") or "cpu"),
            root_cause=RootCause(**cause) if isinstance(cause, dict) else None,
            problem=data.get("problem"),
            included=list(data.get("included") or []),
            rules=data.get("rules") if isinstance(data.get("rules"), str) else None,
            differs=data.get("differs") if isinstance(data.get("differs"), str) else None,
            rules_source=_text(data.get("rules_source")),
            op=data["op"] if data.get("op") in ("layer", "rms") else "layer",
        )

    def verdict(self) -> str:
        """``PASS: 15 of 15 required clauses pass`` or ``FAIL: ...; failed: names``, then the
        clauses run and not counted.

        Example:
            >>> report = GradeReport("f", False, [ClauseResult("values", True, False, 0.1),
            ...                                   ClauseResult("signature", True, True, 0.1)])
            >>> report.verdict()
            'FAIL: 1 of 2 required clauses pass; failed: values'
        """
        if self.problem is not None:
            return f"FAIL: {self.problem}"
        counted = [c for c in self.clauses if c.counted]
        failed = self.failed
        levels = {c.level for c in counted}
        if levels <= {"required"}:
            kind = "required clauses"
        else:
            shares = ", ".join(
                f"{sum(c.level == level for c in counted)} {words}"
                for level, words in LEVEL_WORDS.items()
                if level in levels
            )
            kind = f"counted clauses ({shares})"
        line = f"{len(counted) - len(failed)} of {len(counted)} {kind} pass"
        line = f"{'PASS' if not failed else 'FAIL'}: {line}"
        if failed:
            line += f"; failed: {', '.join(failed)}"
        uncounted = [c for c in self.clauses if not c.counted]
        if uncounted:
            failing = [c.name for c in uncounted if not c.passed]
            line += (
                f"; not counted: {len(uncounted) - len(failing)} of {len(uncounted)} strict pass"
            )
            if failing:
                line += f" (failed: {', '.join(failing)})"
        return line

    def root_cause_lines(self) -> list[str]:
        """The report's first finding, when a known mistake explains failing clauses::

        root cause: one mistake explains all 10 failing clauses, and 3 failing strict clauses
        not counted
          unbiased variance (divides by C - 1)
          fix: use the population variance: ...
        """
        cause = self.root_cause
        if cause is None:
            if self.differs and self.failed:
                return [f"no known cause confirmed; where it differs: {self.differs}"]
            return []
        counted = [c.name for c in self.clauses if c.counted and not c.passed]
        others = [c.name for c in self.clauses if not c.counted and not c.passed]
        explained = [name for name in counted if name in cause.explains]
        extra = [name for name in others if name in cause.explains]
        strict = (
            "the failing strict clause"
            if len(extra) == 1
            else f"{len(extra)} failing strict clauses"
        )
        if not counted:
            what = f"{strict} (not counted)"
        elif len(explained) == len(counted):
            what = (
                "the failing clause" if len(counted) == 1 else f"all {len(counted)} failing clauses"
            )
        else:
            what = (
                f"{len(explained)} of the {len(counted)} failing clauses"
                f" ({', '.join(explained)}); the others fail for other reasons"
            )
        if counted and extra:
            what += f", and {strict} not counted"
        return [
            f"root cause: one mistake explains {what}",
            f"  {cause.description}",
            f"  fix: {cause.fix}",
        ]

    def text(self) -> str:
        """The report as plain text (for :func:`~maskln_cli.grading.assert_conforms` and
        logs)."""
        rules = f", rules {self.rules}" if self.rules else ""
        if self.rules_source:
            rules += f" ({self.rules_source})"
        where = f"op {self.op}, seed {self.seed}, device {self.device}{rules}"
        lines = [f"maskln grade {self.target} ({where})"]
        lines += self.root_cause_lines()
        width = max((len(c.name) for c in self.clauses), default=0)
        for c in self.clauses:
            verdict = "PASS" if c.passed else "FAIL"
            lines.append(f"  {verdict}  {c.name:<{width}}  {c.level:<8}  {c.seconds:6.2f} s")
            shown = clause_detail(c)
            if shown:
                lines.append(f"        {shown}")
        found = diagnosis_lines(self)
        if found:
            lines.append("diagnosis")
            lines += [f"  {line}" for line in found]
        lines.append(self.verdict())
        return "\n".join(lines)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def clause_detail(clause: ClauseResult) -> str | None:
    """What the report says under a failing clause: ``same cause as values`` when it fails only
    through the root cause, else its counterexample or reason."""
    if clause.passed:
        return None
    if clause.cause is not None:
        return f"same cause as {clause.cause}"
    return clause.detail


def diagnosis_lines(report: GradeReport) -> list[str]:
    """One line per diagnosis of a failing clause that the root cause does not explain:
    ``values: likely unbiased variance ...; use ...``."""
    explained = set(report.root_cause.explains) if report.root_cause else set()
    lines = []
    for found in report.diagnosis:
        if found["clause"] in explained:
            continue
        if found["mistake"] is None:
            lines.append(f"{found['clause']}: the result {NO_MATCH}")
        else:
            lines.append(f"{found['clause']}: likely {found['description']}; {found['fix']}")
    return lines
