"""A worker process of a class grade (:mod:`.classroom`): it grades the targets it is sent, one at
a time, each in a child process of its own (:func:`~maskln_cli.grading.runner.grade_target`), and
answers with each report.

Protocol: the grader sends one JSON object per line on the worker's stdin (``{"target": ...,
"strict": ..., "only": [...], "include": [...], "seed": ..., "device": ..., "timeout": ...}``);
the worker answers one JSON line on its stdout for each: ``{"report": ...}`` (a report's
``to_dict()``), or ``{"error": ...}`` when the target cannot be graded at all (it cannot be
imported, say); with ``"tampered": [paths]`` when files the grader loads changed meanwhile.

The worker imports everything it needs, then seals itself (:mod:`.guard`), before any submission
runs; it is a child subreaper (processes a submission detaches come back to it, and are killed
with the submission's child) and not dumpable. It ends when its stdin closes, on SIGTERM (its
current child killed first) or when the grader ends (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from maskln_cli.errors import MasklnError

PARENT_ENV = "_MASKLN_GRADE_PARENT"


class Stopped(BaseException):
    """SIGTERM: stop grading, cleaning up the current child."""


def _stop(signum: int, frame: object) -> None:
    raise Stopped


def grade_one(request: dict[str, Any]) -> dict[str, Any]:
    """The answer to one request."""
    from maskln_cli.grading import guard
    from maskln_cli.grading.runner import grade_target

    try:
        report = grade_target(
            str(request["target"]),
            strict=bool(request.get("strict")),
            only=list(request.get("only") or ()),
            include=list(request.get("include") or ()),
            seed=int(request.get("seed") or 0),
            device=str(request.get("device") or "cpu"),
            timeout=float(request.get("timeout") or 60.0),
            memory_bytes=request.get("memory_bytes"),
            contain_processes=True,
        )
        answer: dict[str, Any] = {"report": report.to_dict()}
    except MasklnError as error:
        answer = {"error": str(error)}
    changed = guard.tampered()
    if changed:
        answer["tampered"] = changed
    return answer


def main() -> int:
    from maskln_cli.grading.processes import die_with_parent

    die_with_parent(os.environ.pop(PARENT_ENV, None))
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the grader's to handle
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr  # nothing else may write into the answers
    from maskln_cli.grading import guard, runner, sandbox  # noqa: F401 (all of it, before any child)

    sandbox.preload()
    with guard.sealing():
        try:
            for line in sys.stdin:
                answers.write(json.dumps(grade_one(json.loads(line))) + "\n")
                answers.flush()
        except (Stopped, BrokenPipeError):
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
