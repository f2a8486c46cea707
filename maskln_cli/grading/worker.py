"""A worker process of a class grade (:mod:`.classroom`): it grades the targets it is sent, one at
a time, each in a child process of its own, forked from it
(:func:`~maskln_cli.grading.runner.grade_target`), and answers with each report.

Started by the class grader with ``python -I`` (:data:`~.child.BOOTSTRAP`: not dumpable before
it imports anything, maskln_cli imported from the grader's own folder, nothing from the current
folder), it imports everything it and its children use, seals itself (:mod:`.guard`; a worker
started later, from the moment the first ones were ready), and only then says it is ready, with
the files it has loaded and the folders it imports from (the class grader checks them before it
starts any other worker). It is never dumpable, and the children it forks never are: no process
of the same user (that is not root) can open its descriptors or its memory, or ptrace it.

Protocol, over a Unix socket inherited from the class grader (its only channel: its stdin and
stdout are /dev/null; ``/proc/<pid>/fd`` cannot open a socket): one JSON object per line each
way. The worker first sends ``{"ready": true, "files": [...], "folders": [...]}``; then for each
``{"job": NONCE, "target": ..., "strict": ..., "only": [...], "include": [...], "seed": ...,
"device": ..., "timeout": ...}`` it answers ``{"job": NONCE, "report": ...}`` (a report's
``to_dict()``), or ``{"job": NONCE, "error": ...}`` when the target cannot be graded at all (it
cannot be imported, say); with ``"tampered": [paths]`` when files the grader loads changed.
The nonce binds each answer to its request: the class grader takes no other.

It ends when its channel closes, on SIGTERM (its current child killed first) or when the class
grader ends (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from typing import Any

from maskln_cli.errors import MasklnError

PARENT_ENV = "_MASKLN_GRADE_PARENT"
SEALED_ENV = "_MASKLN_GRADE_SEALED_AT"
"""For a worker started after the first ones: the moment they were ready, before any submission
ran (``time.time_ns()``), its seal."""


class Stopped(BaseException):
    """SIGTERM: stop grading, cleaning up the current child."""


def _stop(signum: int, frame: object) -> None:
    raise Stopped


def grade_one(request: dict[str, Any]) -> dict[str, Any]:
    """The answer to one request (without its nonce)."""
    from maskln_cli.grading import guard
    from maskln_cli.grading.runner import grade_target

    timeout = request.get("timeout")
    try:
        report = grade_target(
            str(request["target"]),
            strict=bool(request.get("strict")),
            only=list(request.get("only") or ()),
            include=list(request.get("include") or ()),
            seed=int(request.get("seed") or 0),
            device=str(request.get("device") or "cpu"),
            timeout=None if timeout is None else float(timeout),
            memory_bytes=request.get("memory_bytes"),
            contain_processes=True,
            fork_child=True,
            watch=False,  # the class grader watches the folders, for every worker
            op=str(request.get("op") or "layer"),
        )
        answer: dict[str, Any] = {"report": report.to_dict()}
    except MasklnError as error:
        answer = {"error": str(error)}
    changed = guard.tampered()
    if changed:
        answer["tampered"] = changed
    return answer


def main(argv: list[str]) -> int:
    """``python -I -c BOOTSTRAP ROOT maskln_cli.grading.worker CHANNEL``."""
    from maskln_cli.grading.processes import die_with_parent, make_undumpable

    make_undumpable()  # again: the bootstrap's prctl may have failed silently
    die_with_parent(os.environ.pop(PARENT_ENV, None))
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the grader's to handle
    sys.dont_write_bytecode = True  # sealed: a .pyc written now would look like tampering
    channel = socket.socket(fileno=int(argv[0]))
    import torch

    from maskln_cli.grading import guard, runner, sandbox  # noqa: F401 (all of it, before any child)

    sandbox.preload()
    torch.set_num_threads(1)  # as its children do; and no thread pool to copy into a fork
    sealed_at = int(os.environ.pop(SEALED_ENV, "0") or 0) or None
    with guard.sealing(at=sealed_at):
        files = sorted(set(guard.loaded_files()))
        ready = {"ready": True, "files": files, "folders": guard.search_folders()}
        try:
            channel.sendall((json.dumps(ready) + "\n").encode())
            for line in channel.makefile("rb"):
                request = json.loads(line)
                answer = {**grade_one(request), "job": request.get("job")}
                channel.sendall((json.dumps(answer) + "\n").encode())
        except (Stopped, BrokenPipeError, ConnectionError):
            return 0
    return 0
