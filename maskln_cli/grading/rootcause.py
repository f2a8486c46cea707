"""The root cause of a failing grade: the one known mistake that explains the most failing
clauses, so that a student fixes one thing and sees most of the report turn green.

A mistake named in some clause's diagnosis explains a failing clause when that clause's own
diagnosis names it too, or when the clause, judged again with the mistake assumed instead of
the specification (its formula as the reference, its precision allowed:
:mod:`maskln_cli.grading.clauses.assumed`), passes: the function does exactly that mistake
there, and nothing else wrong. The mistake that explains the most clauses wins (the first named,
in table order, on a tie); the clauses it explains are marked as failing through it, and their
diagnoses keep only it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from maskln_cli.grading.clauses import Case, Clause, ClauseRun, Misbehaved
from maskln_cli.grading.clauses.assumed import Assumption, assuming
from maskln_cli.grading.report import ClauseResult, RootCause
from maskln_cli.op.mistakes import LOWER_PRECISION, MISTAKES, MORE_MISTAKES, correct

ORIGINS = ("values", "no_reinit", "dtypes")
"""Where a report says clauses fail through (``same cause as values``) when several name the
mistake: the clause that checks what it is about, else the first."""


@dataclass
class Judged:
    """A clause graded: its cases, what the function gave, and the verdict."""

    clause: Clause
    cases: list[Case]
    run: ClauseRun
    result: ClauseResult


def find_root_cause(judged: Sequence[Judged]) -> RootCause | None:
    """The root cause of the failures among ``judged`` (None when no known mistake explains
    any); marks the clauses it explains (``cause``) and trims their diagnoses to it."""
    failing = [j for j in judged if not j.result.passed]
    candidates = _candidates(failing)
    best: tuple[str, dict[str, Any], list[str]] | None = None
    for mistake, entry in candidates.items():
        assumption = _assumption(mistake, judged)
        explains = [j.result.name for j in failing if _explains(mistake, assumption, j)]
        if explains and (best is None or len(explains) > len(best[2])):
            best = (mistake, entry, explains)
    if best is None:
        return None
    mistake, entry, explains = best
    named = [j.result.name for j in failing if mistake in _named(j.result)]
    origin = next((name for name in ORIGINS if name in named), named[0])
    for j in failing:
        if j.result.name not in explains:
            continue
        if j.result.name != origin:
            j.result.cause = origin
        found = [d for d in j.result.diagnosis or [] if d.get("mistake") == mistake]
        if found:
            j.result.diagnosis = found[:1]
    return RootCause(mistake, entry["description"], entry["fix"], origin, explains)


def _named(result: ClauseResult) -> list[str]:
    return [d.get("mistake") for d in result.diagnosis or [] if d.get("mistake")]


def _candidates(failing: Sequence[Judged]) -> dict[str, dict[str, Any]]:
    """Every mistake a failing clause's diagnosis names, with its first diagnosis (the words
    a report shows), in table order."""
    found: dict[str, dict[str, Any]] = {}
    for j in failing:
        for diagnosis in j.result.diagnosis or []:
            name = diagnosis.get("mistake")
            if name:
                found.setdefault(name, diagnosis)
    return found


def _assumption(mistake: str, judged: Sequence[Judged]) -> Assumption | None:
    """How the clauses judge ``mistake`` assumed: its formula, or its precision; None for a
    mistake without either (a NaN from the padding: only clauses naming it are explained)."""
    if mistake == "parameters_reinitialized":
        return Assumption(formula=_reinitialized_formula(judged))
    formula = MISTAKES.get(mistake) or MORE_MISTAKES.get(mistake)
    if formula is not None:
        return Assumption(formula=formula.formula)
    precision = LOWER_PRECISION.get(mistake)
    if precision is not None:
        return Assumption(precision=precision)
    return None


def _reinitialized_formula(judged: Sequence[Judged]) -> Any:
    """The op with scale and bias as the function left them: the values no_reinit or
    no_mutation saw them reinitialized to (ones and zeros when they saw nothing)."""
    values: dict[str, float] = {}
    for j in judged:
        for facts in j.run.meta.values():
            found = facts.get("reinitialized") if isinstance(facts, dict) else None
            if isinstance(found, dict):
                values.update({k: float(v) for k, v in found.items() if k in ("scale", "bias")})
    if not values:
        values = {"scale": 1.0, "bias": 0.0}

    def formula(x, valid, scale, bias, eps):
        # Reinitialized in place: the new values, and the gradient still reaching the tensor.
        if "scale" in values:
            scale = scale - scale.detach() + values["scale"]
        if "bias" in values:
            bias = bias - bias.detach() + values["bias"]
        return correct(x, valid, scale, bias, eps)

    return formula


def _explains(mistake: str, assumption: Assumption | None, j: Judged) -> bool:
    if mistake in _named(j.result):
        return True
    if assumption is None or j.run.failure is not None:
        return False
    try:
        with assuming(assumption):
            return j.clause.judge(j.cases, j.run).passed
    except (Misbehaved, RuntimeError, TypeError, ValueError, KeyError, IndexError):
        return False
