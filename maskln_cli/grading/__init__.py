"""Grading: any implementation of masked layer normalization against its whole contract.

This package knows the contract as clauses (:mod:`.clauses`: cases, runs and judges), the runner
that grades a function clause by clause into a plain-data report (:mod:`.runner`), where a
graded function is found (:mod:`.targets`), the child process that runs a solution so that
its crash, hang or memory bomb fails only a clause (:mod:`.sandbox`, :mod:`.child`), confined so
that it reaches no other process (:mod:`.confine`), and a class graded by workers no submission
can reach or answer for (:mod:`.classroom`, :mod:`.worker`).

It may import the op (the reference and the catalogue of known mistakes), the files package and
the error types; never comparison, verify, jobs or the command line, and it never renders:
reports are plain data for the face to show.

    >>> from maskln_cli.grading import grade, assert_conforms
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from maskln_cli.grading.runner import (
        CLAUSES,
        DEFAULT_SEED,
        DEFAULT_TIMEOUT,
        ClauseResult,
        GradeReport,
        assert_conforms,
        grade,
        grade_target,
        run_clause,
    )
    from maskln_cli.grading.targets import load_target

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


def __getattr__(name: str) -> Any:
    # Lazily: the command line checks its arguments before anything imports torch.
    if name == "load_target":
        from maskln_cli.grading import targets

        return targets.load_target
    if name in __all__:
        from maskln_cli.grading import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'maskln_cli.grading' has no attribute {name!r}")
