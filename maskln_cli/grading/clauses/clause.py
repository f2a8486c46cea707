"""What a clause is (:class:`Clause`: a name, a summary, its cases, a run and a judge), and the
run and judge most clauses share: make a list of calls, judge their outputs and gradients (or
judge each case's one call in a clause's own way).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from maskln_cli.grading.clauses.calls import Call, ClauseRun, Fn, one_call_each, run_calls
from maskln_cli.grading.clauses.cases import Case
from maskln_cli.grading.clauses.causes import explain_exception
from maskln_cli.grading.clauses.judging import PASSED, Verdict, failure_detail, judge_outputs

LEVELS = ("required", "strict", "optional")
"""A clause's level: ``required``, a sentence of the specification; ``strict``, one of maskln's
own stronger guarantees; ``optional``, beyond the specification (half precision), graded only
when asked for."""


@dataclass(frozen=True)
class Clause:
    """One property of the contract, of a level (:data:`LEVELS`).

    ``build(seed)`` makes the cases; ``run(fn, cases, device)`` calls the function (in the
    child, for ``maskln grade``); ``judge(cases, run)`` gives the verdict (in the parent).
    """

    name: str
    level: str
    summary: str
    build: Callable[[int], list[Case]]
    run: Callable[[Fn, list[Case], str], ClauseRun]
    judge: Callable[[list[Case], ClauseRun], Verdict]

    @property
    def required(self) -> bool:
        return self.level == "required"

    def __repr__(self) -> str:
        return f"Clause({self.name!r}, {self.level})"


Run = Callable[[Fn, list[Case], str], ClauseRun]
Judge = Callable[[list[Case], ClauseRun], Verdict]
CallsOf = Callable[[list[Case]], list[Call]]


def calls_run(calls: Callable[[list[Case]], list[Call]]) -> Run:
    def run(fn: Fn, cases: list[Case], device: str) -> ClauseRun:
        return run_calls(fn, cases, calls(cases), device)

    return run


def outputs_judge(
    calls: Callable[[list[Case]], list[Call]],
    diagnose: bool = True,
    what: Callable[[Call], str] = lambda call: "",
) -> Judge:
    def judge(cases: list[Case], run: ClauseRun) -> Verdict:
        return judge_outputs(cases, run, calls(cases), diagnose, what)

    return judge


def each_call_judge(verdict: Callable[[Case, Call, ClauseRun], Verdict | None]) -> Judge:
    """A judge of one call of each case (:func:`one_call_each`): the first call that failed,
    else the first ``verdict`` on a call that ran (None: the call is right), else a pass."""

    def judge(cases: list[Case], run: ClauseRun) -> Verdict:
        for call in one_call_each(cases):
            case = cases[call.case]
            problem = failure_detail(case, call, run)
            if problem is not None:
                return Verdict(False, problem)
            found = verdict(case, call, run)
            if found is not None:
                return found
        return PASSED

    return judge


def make_clause(
    name: str,
    level: str,
    summary: str,
    build: Callable[[int], list[Case]],
    calls: CallsOf | None = None,
    run: Run | None = None,
    judge: Judge | None = None,
) -> Clause:
    """A clause; by default it makes ``calls`` and judges their outputs (and gradients)."""
    assert level in LEVELS, level
    if run is None or judge is None:
        assert calls is not None
    return Clause(
        name,
        level,
        summary,
        build,
        run or calls_run(calls),
        with_exception_causes(judge or outputs_judge(calls)),
    )


def with_exception_causes(judge: Judge) -> Judge:
    """``judge``, whose failures that no known mistake explains are explained by the words of
    the exception they show, when torch's message says what happened (a broadcasting or
    dtype error, .view on a strided tensor: :mod:`.causes`)."""

    def judged(cases: list[Case], run: ClauseRun) -> Verdict:
        verdict = judge(cases, run)
        if not verdict.passed and not verdict.diagnosis:
            found = explain_exception(verdict.detail)
            if found is not None:
                verdict.diagnosis = [found]
        return verdict

    return judged
