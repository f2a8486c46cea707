"""Run a markdown walk-through's code blocks in order, as a reader would, in one folder.

``python`` blocks run in one namespace; a ``text`` block right after one is what it prints.
``console`` blocks hold ``$ COMMAND`` lines (a trailing backslash continues one), each
followed by what it prints (stdout and stderr, as a terminal 200 columns wide shows them): a
plain ``maskln`` command runs in this process (torch is imported already), anything else
(a loop) in bash with this interpreter's folder first on PATH. In what a block shows, a line
that is only ``...`` stands for any number of lines, and ``...`` inside a line for any text.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.DOTALL | re.MULTILINE)


@dataclass
class Step:
    kind: str  # "python" or "console"
    code: str
    shown: str | None  # what the document says it prints, if it says
    line: int  # where the block starts in the document


def steps(markdown: str) -> list[Step]:
    """The document's runnable steps, in order."""
    found: list[Step] = []
    for match in FENCE.finditer(markdown):
        kind, body = match.group(1), match.group(2)
        line = markdown.count("\n", 0, match.start()) + 1
        if kind == "python":
            found.append(Step("python", body, None, line))
        elif kind == "text" and found and found[-1].kind == "python" and found[-1].shown is None:
            found[-1].shown = body
        elif kind == "console":
            found += _commands(body, line)
    return found


def _commands(body: str, line: int) -> list[Step]:
    commands: list[Step] = []
    lines = body.splitlines(keepends=True)
    index = 0
    while index < len(lines):
        if not lines[index].startswith("$ "):
            raise ValueError(f"line {line + index + 1}: output before any '$ ' command")
        command = lines[index][2:]
        while command.rstrip("\n").endswith("\\"):
            index += 1
            command += lines[index]
        index += 1
        start = index
        while index < len(lines) and not lines[index].startswith("$ "):
            index += 1
        commands.append(Step("console", command, "".join(lines[start:index]), line))
    return commands


def run_step(step: Step, namespace: dict[str, object], folder: Path) -> str:
    """Run one step in ``folder``; return what it printed."""
    if step.kind == "python":
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(step.code, f"<block at line {step.line}>", "exec"), namespace)
        return printed.getvalue()
    command = step.code.replace("\\\n", " ")
    if command.startswith("maskln ") and not re.search(r"[;|&$<>`()]", command):
        from typer.testing import CliRunner

        from maskln_cli.cli.app import app

        result = CliRunner(env={"COLUMNS": "200"}).invoke(app, shlex.split(command)[1:])
        return result.output
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    environment = {**os.environ, "PATH": path, "COLUMNS": "200", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        ["bash", "-c", step.code],
        cwd=folder,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    return result.stdout


def matches(shown: str, printed: str) -> bool:
    """Whether ``printed`` is what ``shown`` shows (see the module's docstring for ``...``)."""
    pattern = []
    for line in shown.rstrip("\n").split("\n"):
        if line.strip() == "...":
            pattern.append(r"(?:[^\n]*\n)*?")
        else:
            pattern.append(r"[^\n]*".join(map(re.escape, line.rstrip().split("..."))) + r"\n")
    text = "\n".join(line.rstrip() for line in printed.rstrip("\n").split("\n")) + "\n"
    return re.fullmatch("".join(pattern), text, re.DOTALL) is not None
