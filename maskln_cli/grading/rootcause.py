"""The root cause of a failing grade: the one known mistake that explains the most failing
clauses, so that a student fixes one thing and sees most of the report turn green.

A mistake is named only when a test confirms it (:mod:`maskln_cli.grading.confirm`: the
counterexample called again, with the suspected cause's condition varied): the causes the
failing clauses suggest are probed first, and those refuted are dropped from every clause's
diagnosis (a probe may show another cause instead: a result that depends on earlier calls).
Without a confirmed cause, a report says where it differs (:func:`where_it_differs`).

A mistake named in some clause's diagnosis explains a failing clause when that clause's own
diagnosis names it too, or when the clause, judged again with the mistake assumed instead of
the specification (its formula as the reference, its precision allowed:
:mod:`maskln_cli.grading.clauses.assumed`), passes: the function does exactly that mistake
there, and nothing else wrong. The mistake that explains the most clauses wins (the first named,
in table order, on a tie); the clauses it explains are marked as failing through it, and their
diagnoses keep only it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from maskln_cli.grading.clauses import Case, Clause, ClauseRun, Misbehaved
from maskln_cli.grading.clauses.assumed import Assumption, assuming
from maskln_cli.grading.clauses.calls import Call
from maskln_cli.grading.clauses.catalogue import formulas
from maskln_cli.grading.confirm import KINDS, OBSERVED, Outcome
from maskln_cli.grading.exercise import current
from maskln_cli.grading.report import ClauseResult, RootCause
from maskln_cli.op.mistakes import LOWER_PRECISION, correct

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
    case: int | None = None
    call: Call | None = None

    def counterexample(self) -> int | None:
        """The index of the clause's counterexample among its cases: the judge's, else the
        case whose label (the longest) begins the failure's words."""
        if self.case is not None:
            return self.case
        detail = self.result.detail or ""
        found = [(len(c.label), i) for i, c in enumerate(self.cases) if detail.startswith(c.label)]
        return max(found)[1] if found else None


Confirm = Callable[[str, Judged], Outcome]
"""Runs the probe of a mistake on a judged clause's counterexample (:mod:`.confirm`)."""
OBSERVED_BY = {"parameters_reinitialized": ("no_reinit", "no_mutation")}
"""Causes some clauses observe themselves (scale and bias holding new values after the call),
though elsewhere only a formula suggests them."""
MAX_PROBES = 8
"""How many suspected causes a grade probes at most (the most named first)."""


def find_root_cause(judged: Sequence[Judged], confirm: Confirm | None = None) -> RootCause | None:
    """The root cause of the failures among ``judged`` (None when no confirmed mistake
    explains any); marks the clauses it explains (``cause``) and trims their diagnoses to it.
    ``confirm`` probes a suspected cause; without it only causes a clause observed itself are
    named."""
    failing = [j for j in judged if not j.result.passed]
    confirmed_only(failing, confirm)
    candidates = _candidates(failing)
    # Where counted clauses fail, the root cause is one that explains some of them: a cause of
    # strict clauses alone (a custom backward's second derivative) is not why the grade fails.
    counted = {j.result.name for j in failing if j.result.counted}
    best: tuple[tuple[int, int], str, dict[str, Any], list[str]] | None = None
    for mistake, entry in candidates.items():
        assumption = _assumption(mistake, judged)
        explains = [j.result.name for j in failing if _explains(mistake, assumption, j)]
        rank = (len(counted.intersection(explains)), len(explains))
        if explains and (rank[0] or not counted) and (best is None or rank > best[0]):
            best = (rank, mistake, entry, explains)
    if best is None:
        return None
    _, mistake, entry, explains = best
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


def confirmed_only(failing: Sequence[Judged], confirm: Confirm | None) -> None:
    """Each failing clause's diagnosis, kept to the causes its probes confirm (the most named
    probed first, :data:`MAX_PROBES` at most); a cause a probe showed instead joins it."""
    counts: dict[str, int] = {}
    first: dict[str, Judged] = {}
    for j in failing:
        for name in dict.fromkeys(_named(j.result)):
            counts[name] = counts.get(name, 0) + 1
            first.setdefault(name, j)
    outcomes: dict[str, Outcome] = {}
    probed = 0
    observing = {
        name
        for j in failing
        for name in _named(j.result)
        if j.clause.name in OBSERVED_BY.get(name, ())
    }
    for name in sorted(counts, key=lambda n: -counts[n]):
        allowed = current().confirms
        if allowed is not None and KINDS.get(name) not in allowed:
            outcomes[name] = Outcome(False)  # a cause this exercise's probes cannot confirm
        elif KINDS.get(name) == OBSERVED or name in observing:
            outcomes[name] = Outcome(True)
        elif confirm is None or probed >= MAX_PROBES or first[name].counterexample() is None:
            outcomes[name] = Outcome(False)
        else:
            probed += 1
            outcomes[name] = confirm(name, first[name])
    for name, outcome in list(outcomes.items()):
        if outcome.alternative is not None:
            j = first[name]
            shown = outcome.alternative.to_dict()
            if shown["mistake"] not in _named(j.result):
                j.result.diagnosis = [*(j.result.diagnosis or []), shown]
            outcomes.setdefault(shown["mistake"], Outcome(True))
    for j in failing:
        if j.result.diagnosis:
            kept = [d for d in j.result.diagnosis
                    if outcomes.get(d.get("mistake") or "", Outcome(False)).confirmed]  # fmt: skip
            j.result.diagnosis = kept or None  # refuted: the counterexample says where


def _suggested(j: Judged) -> set[str]:
    """What the clause's own failure words suggest (an exception's cause), confirmed or not."""
    from maskln_cli.grading.clauses.causes import explain_exception

    found = explain_exception(j.result.detail)
    return {found.mistake} if found is not None else set()


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
    formula = formulas().get(mistake)
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
    if mistake in LOWER_PRECISION and "dtype_error" in _suggested(j):
        return True  # an output in another dtype meets the caller's tensors: torch says so
    if assumption is None or j.run.failure is not None:
        return False
    try:
        with assuming(assumption):
            return j.clause.judge(j.cases, j.run).passed
    except (Misbehaved, RuntimeError, TypeError, ValueError, KeyError, IndexError):
        return False


GRADIENTS = ("grad_x", "grad_scale", "grad_bias")


def where_it_differs(judged: Sequence[Judged]) -> str | None:
    """Where the first failing clause (a counted one first) differs, in words, for a report
    with no confirmed cause: which of the output and the gradients are wrong, in valid or
    invalid rows, and on which case (its family of data leads its label)."""
    failing = [j for j in judged if not j.result.passed and j.run.failure is None]
    failing.sort(key=lambda j: not j.result.counted)
    for j in failing:
        index = j.counterexample()
        if index is None:
            continue
        case = j.cases[index]
        wrong, fine = _differences(j, case)
        if not wrong:
            continue
        shown = f"differs in {_listed(wrong)}"
        if fine:
            shown += f" ({_listed(fine)} right)"
        return f"{j.result.name}: {shown}, on {case.label}"
    return None


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _differences(j: Judged, case: Case) -> tuple[list[str], list[str]]:
    """(what differs, what is right) at the counterexample: from its tensors when the judge
    named its call, else from the failure's words."""
    from maskln_cli.grading.clauses.judging import (
        grad_mismatch,
        reference_gradients,
        value_mismatch,
    )

    detail = j.result.detail or ""
    call = j.call
    if call is None or f"{call.key}.out" not in j.run.tensors:
        named = [name for name in GRADIENTS if name in detail] or ["out"]
        rows = " (in an invalid row)" if "(an invalid row)" in detail else ""
        return [f"{named[0]}{rows}"], []
    keep = case.inputs()["valid"][..., None]
    expected = {"out": case.reference()}
    if call.backward:
        expected.update(reference_gradients(case, call.requires))
    wrong, fine = [], []
    for name, reference in expected.items():
        actual = j.run.tensors.get(f"{call.key}.{name}")
        if actual is None:
            continue
        check = value_mismatch if name == "out" else grad_mismatch
        if check(actual, reference, case.x.dtype) is None:
            fine.append(name)
            continue
        if name in ("out", "grad_x") and tuple(actual.shape) == tuple(reference.shape):
            inside = check(torch.where(keep, actual, 0.0), torch.where(keep, reference, 0.0),
                           case.x.dtype) is not None  # fmt: skip
            outside = check(torch.where(keep, 0.0, actual), torch.where(keep, 0.0, reference),
                            case.x.dtype) is not None  # fmt: skip
            rows = {(True, False): " in valid rows only", (False, True): " in invalid rows only"}
            name += rows.get((inside, outside), "")
        wrong.append(name)
    return wrong, fine
