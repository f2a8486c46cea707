"""Run the examples of the documentation: every Python and every console block of a page.

A page's blocks run in order, in a fresh folder of their own (``sample_data``, ``examples`` and
``scripts`` are linked into it), and share what they leave there and one Python namespace:

- ``python`` blocks are executed in this process; one with ``title="NAME"`` is a file the reader
  saves: it is written to NAME before any block runs (a console block then runs it).
- ``pyfile`` blocks list a file of the repository (``--8<-- "examples/my_kernel.py"``, which the
  site includes, highlighted as Python); the file must exist and compile.
- ``pycon`` blocks (``>>>`` prompts) are doctests: the output shown must be the output given.
- a ``text`` block right after a ``python`` block is what that block prints (stdout).
- ``console`` blocks are commands after ``$ `` (a line ending in ``\\`` goes on), each followed
  by what it prints, stdout and stderr together, as a terminal shows them, 100 columns wide. A
  plain ``maskln ...`` command runs in this process (Typer's test runner: the same app, without
  importing torch again; ``MASKLN_DOCS_SUBPROCESS=1`` runs it as a real process instead); any
  other runs in bash, with the project's ``.venv/bin`` first on PATH. A line ``...`` (optionally
  followed by a remark in parentheses) stands for any number of lines, and ``...`` inside a line
for any text (a version number, say).

Pages are made and checked in a process whose torch, MKL and oneDNN compute alike on most
x86-64 CPUs (``NUMERIC_ENV``): run otherwise, the runner starts itself again so.

Before comparing, both sides are normalized alike: timings (``0.05 s``, ``"seconds": 0.265``,
``in 3.21s``) become ``<t>``, the folder's own path is dropped, trailing spaces are ignored.
Figures are compared as figures.py says: never to their last digits, which vary by machine.

Regenerate every console block's output from real runs::

    .venv/bin/python -m tests.docs.runner --update            # README.md, CONTRIBUTING.md, docs/
    .venv/bin/python -m tests.docs.runner --update docs/commands/verify.md

(``make docs-examples`` runs the first.) A block with ``...`` keeps the lines shown before and
after it, counted as before.
"""

from __future__ import annotations

import argparse
import contextlib
import doctest
import io
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.docs.figures import same_figures

ROOT = Path(__file__).resolve().parents[2]
LINKED = ("sample_data", "examples", "scripts")
EXECUTED = ("python", "pyfile", "pycon", "console")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,})(?P<info>[^`]*)$")
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$')
ELLIPSIS = re.compile(r"^\s*\.\.\.(\s+\(.*\))?\s*$")
TIMINGS = (
    (re.compile(r"\b\d+\.\d+ s\b"), "<t> s"),
    (re.compile(r'("seconds": )[0-9.e-]+'), r"\1<t>"),
    (re.compile(r"\bin \d+\.\d+s\b"), "in <t>s"),
)
COLUMNS = 100
PAGE_THREADS = 2
"""torch's thread count while a page's Python runs in this process: a figure a page shows can
depend on it (a sum over rows in a model's backward), and pytest's workers run torch on one
thread each (tests/conftest.py). Pages are made (``--update``) and checked with this count."""

NUMERIC_ENV = {
    # torch's CPU kernels without the CPU's vector extensions (AVX2 and AVX-512 sum in other
    # orders), MKL's and oneDNN's code paths the same on every x86-64 CPU, and one thread count
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "OMP_NUM_THREADS": str(PAGE_THREADS),
    "MKL_NUM_THREADS": str(PAGE_THREADS),
    # torch 2.13's compiled-graph cache is not keyed by ATEN_CPU_CAPABILITY: a graph cached by a
    # process with AVX-512 kernels, run by one without, computes garbage. A cache of their own.
    "TORCHINDUCTOR_CACHE_DIR": os.path.join(
        tempfile.gettempdir(), f"torchinductor_{os.environ.get('USER', 'maskln')}_docs"
    ),
}
"""The figures a page shows are rounding: the last digits of a float32 kernel's error depend on
the order its sums run in, which torch, MKL and oneDNN choose by the CPU's instruction set (and
by the thread count). Pages are made and checked in a process with this environment, set before
torch is imported, so that most of what they show is what every x86-64 CPU prints, bit for bit.
Not all of it: an AMD EPYC still printed a float32 kernel's error 20% off an Intel Xeon's, so
figures are never compared to their last digits (figures.py). maskln's own kernels give the same
bits on every instruction set."""


def pinned(env: Mapping[str, str] = os.environ) -> bool:
    """Whether a process with this environment computes as the pages were made."""
    return all(env.get(key) == value for key, value in NUMERIC_ENV.items())


def pinned_environment() -> dict[str, str]:
    return {**os.environ, **NUMERIC_ENV}


def pages() -> list[Path]:
    """Every page whose examples run: the README, CONTRIBUTING and the docs."""
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


@dataclass
class Block:
    """A fenced block: its language, its attributes (``title``), its lines (dedented) and where
    they are in the page (``start`` and ``end``: the lines of the fences)."""

    lang: str
    attributes: dict[str, str]
    lines: list[str]
    start: int
    end: int
    indent: str

    @property
    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def blocks_of(text: str) -> list[Block]:
    found = []
    lines = text.split("\n")
    number = 0
    while number < len(lines):
        opening = FENCE.match(lines[number])
        if not opening:
            number += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        info = opening["info"].strip()
        lang, _, rest = info.partition(" ")
        attributes = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        end = number + 1
        while end < len(lines) and lines[end] != indent + fence:
            end += 1
        if end == len(lines):
            raise ValueError(f"line {number + 1}: a fence that is never closed")
        body = [
            line[len(indent) :] if line.startswith(indent) else line.lstrip()
            for line in lines[number + 1 : end]
        ]
        found.append(Block(lang.lstrip("{").lstrip("."), attributes, body, number, end, indent))
        number = end + 1
    return found


def expand_snippets(block: Block) -> str:
    """The block's code, with ``--8<-- "path"`` lines replaced by the file (from the root)."""
    out = []
    for line in block.lines:
        match = SNIPPET.match(line.strip())
        out.append((ROOT / match["path"]).read_text().rstrip("\n") if match else line)
    return "\n".join(out) + "\n"


# --- console blocks ------------------------------------------------------------------------------


@dataclass
class Command:
    command: str  # as bash reads it, continuation lines included
    shown: list[str] = field(default_factory=list)  # the output the page shows


def commands_of(block: Block) -> list[Command]:
    commands: list[Command] = []
    going_on = False
    for line in block.lines:
        if going_on:
            commands[-1].command += "\n" + line
            going_on = line.endswith("\\")
        elif line.startswith("$ "):
            commands.append(Command(line[2:]))
            going_on = line.endswith("\\")
        elif commands:
            commands[-1].shown.append(line)
        elif line.strip():
            raise ValueError(f"console block at line {block.start + 1}: output before any '$ '")
    return commands


def environment() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTEST", "COV_", "MASKLN_")) and key not in ("FORCE_COLOR",)
    }
    env.update(
        NUMERIC_ENV,
        PATH=bin_dir + os.pathsep + env.get("PATH", ""),
        COLUMNS=str(COLUMNS),
        NO_COLOR="1",
        TERM="dumb",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",  # save_pretrained's bar: timings, on stderr
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


SHELL_ONLY = re.compile(r"[|;&<>$`*?~(){}\[\]]")
"""A command with any of these is run by bash; a plain ``maskln ...`` runs in this process."""


def in_process(command: str) -> list[str] | None:
    """The arguments of a plain ``maskln`` command (no pipe, redirection, glob or variable), which
    runs in this process through Typer's test runner, as the console script would run it but
    without importing torch again (about 2 s a command); None for anything else. Its output is
    stdout and stderr interleaved, as a terminal shows them. MASKLN_DOCS_SUBPROCESS=1 runs every
    command in bash instead."""
    if os.environ.get("MASKLN_DOCS_SUBPROCESS") or SHELL_ONLY.search(command):
        return None
    words = shlex.split(command.replace("\\\n", " "), comments=True)
    return words[1:] if words and words[0] == "maskln" else None


def run_command(command: str, folder: Path) -> tuple[list[str], int]:
    arguments = in_process(command)
    if arguments is not None:
        from typer.testing import CliRunner

        from maskln_cli.cli.app import app

        env = {"COLUMNS": str(COLUMNS), "NO_COLOR": "1", "TERM": "dumb"}
        result = CliRunner(env=env).invoke(app, arguments, prog_name="maskln")
        text = result.output
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            text += "".join(traceback.format_exception(result.exception))
        return _lines(text, folder), result.exit_code
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=folder,
        env=environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=600,
    )
    return _lines(done.stdout.decode("utf-8", "replace"), folder), done.returncode


def _lines(text: str, folder: Path) -> list[str]:
    text = text.replace(str(folder) + "/", "")
    return [line.rstrip() for line in text.rstrip("\n").split("\n")] if text.strip() else []


def normalized(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        line = line.rstrip()
        for pattern, replacement in TIMINGS:
            line = pattern.sub(replacement, line)
        out.append(line)
    while out and not out[-1]:
        out.pop()
    return out


def line_matches(shown: str, real: str) -> bool:
    """Whether one real line is the shown one, ``...`` inside it standing for any text, and its
    figures the shown ones within what varies by machine (figures.py)."""
    if shown == real:
        return True
    if "..." not in shown:
        return same_figures(shown, real)
    return re.fullmatch(".*".join(map(re.escape, shown.split("..."))), real) is not None


def _equal(shown: list[str], real: list[str]) -> bool:
    return len(shown) == len(real) and all(map(line_matches, shown, real))


def matches(shown: list[str], real: list[str]) -> bool:
    """Whether the real output is what is shown, a ``...`` line standing for any lines."""
    shown, real = normalized(shown), normalized(real)
    pieces: list[list[str]] = [[]]
    for line in shown:
        if ELLIPSIS.match(line):
            pieces.append([])
        else:
            pieces[-1].append(line)
    if len(pieces) == 1:
        return _equal(shown, real)
    first, *middle, last = pieces
    if len(real) < len(first) + len(last) or not _equal(first, real[: len(first)]):
        return False
    if last and not _equal(last, real[len(real) - len(last) :]):
        return False
    at, stop = len(first), len(real) - len(last)
    for piece in middle:
        starts = range(at, stop - len(piece) + 1)
        found = next((i for i in starts if _equal(piece, real[i : i + len(piece)])), None)
        if found is None:
            return False
        at = found + len(piece)
    return True


def regenerated(shown: list[str], real: list[str]) -> list[str]:
    """What to show for ``real``: all of it, or, where one ``...`` elides lines, as many lines
    before and after it as were shown."""
    cuts = [i for i, line in enumerate(shown) if ELLIPSIS.match(line)]
    if len(cuts) != 1:
        return _kept(shown, real)
    head, tail = cuts[0], len(shown) - cuts[0] - 1
    if head + tail >= len(real):
        return _kept(shown, real)
    kept = [*_kept(shown[:head], real[:head]), shown[cuts[0]]]
    return kept + (_kept(shown[head + 1 :], real[len(real) - tail :]) if tail else [])


def _kept(shown: list[str], real: list[str]) -> list[str]:
    """``real``, keeping a shown line with ``...`` inside it where it still matches."""
    return [
        shown[i] if i < len(shown) and "..." in shown[i] and line_matches(shown[i], line) else line
        for i, line in enumerate(real)
    ]


# --- a page --------------------------------------------------------------------------------------


class ExampleFailed(AssertionError):
    pass


def prepare(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        link = folder / name
        if not link.exists():
            link.symlink_to(ROOT / name, target_is_directory=True)


def run_page(page: Path, folder: Path, update: bool = False) -> int:
    """Run every example of ``page`` in ``folder``; return how many blocks ran. With ``update``,
    rewrite the console blocks' output with the real one; else raise ExampleFailed at the first
    block whose output differs."""
    prepare(folder)
    text = page.read_text()
    lines = text.split("\n")
    every = blocks_of(text)
    blocks = [b for b in every if b.lang in EXECUTED]
    printed_by = printed_blocks(every, lines)
    where = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    for block in blocks:
        if block.lang == "python" and "title" in block.attributes:
            target = folder / block.attributes["title"]
            if not target.parent.resolve().is_relative_to(folder.resolve()):
                raise ExampleFailed(f"{where}:{block.start + 1}: {target} is outside the folder")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(expand_snippets(block))
    namespace: dict[str, object] = {"__name__": "__main__"}
    replacements: list[tuple[Block, list[str]]] = []
    before = Path.cwd()
    os.chdir(folder)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(PAGE_THREADS)
    try:
        for block in blocks:
            label = f"{where}:{block.start + 1}"
            if block.lang == "pyfile" or "title" in block.attributes:
                compile(expand_snippets(block), label, "exec")
            elif block.lang == "python":
                shown = printed_by.get(block.start)
                printed = io.StringIO()
                with contextlib.redirect_stdout(printed):
                    exec(compile(expand_snippets(block), label, "exec"), namespace)
                if shown is not None:
                    new = compare_printed(shown, printed.getvalue(), label, update)
                    if new is not None:
                        replacements.append((shown, new))
            elif block.lang == "pycon":
                run_doctest(block.text, namespace, label)
            else:
                new = run_console(block, folder, label, update)
                if new is not None:
                    replacements.append((block, new))
    finally:
        os.chdir(before)
        torch.set_num_threads(threads)
    if update and replacements:
        for block, new in sorted(replacements, key=lambda r: -r[0].start):
            lines[block.start + 1 : block.end] = [
                block.indent + line if line else line for line in new
            ]
        page.write_text("\n".join(lines))
    return len(blocks)


def printed_blocks(every: list[Block], lines: list[str]) -> dict[int, Block]:
    """The ``text`` blocks that show what a ``python`` block prints: each right after its block
    (nothing but blank lines between), by the python block's first line."""
    found = {}
    for block, after in itertools.pairwise(every):
        between = lines[block.end + 1 : after.start]
        if block.lang == "python" and after.lang == "text" and not "".join(between).strip():
            found[block.start] = after
    return found


def differs(label: str, what: str, real: list[str], shown: list[str]) -> ExampleFailed:
    """The failure of an example whose output is not what its page shows."""
    return ExampleFailed(
        f"{label}: {what}:\n"
        + "\n".join(real)
        + "\n\nthe page shows:\n"
        + "\n".join(shown)
        + "\n\nregenerate: .venv/bin/python -m tests.docs.runner --update "
        + shlex.quote(label.split(":")[0])
    )


def compare_printed(shown: Block, printed: str, label: str, update: bool) -> list[str] | None:
    """Compare what a python block printed with the text block after it; with ``update``, the
    text block's new lines when they differ."""
    real = [line.rstrip() for line in printed.rstrip("\n").split("\n")] if printed.strip() else []
    if matches(shown.lines, real):
        return None
    if not update:
        raise differs(label, "the block printed", real, shown.lines)
    print(f"{label}: updated what the block prints", file=sys.stderr)
    return regenerated(shown.lines, real)


def run_console(block: Block, folder: Path, label: str, update: bool) -> list[str] | None:
    """Run a console block; with ``update``, the block's new lines when its output changed."""
    new_lines: list[str] = []
    changed = False
    for command in commands_of(block):
        real, code = run_command(command.command, folder)
        first, *rest = command.command.split("\n")
        new_lines += ["$ " + first, *rest]
        if matches(command.shown, real):
            new_lines += command.shown
            continue
        if not update:
            what = f"$ {command.command}\n(exit code {code}) printed"
            raise differs(label, what, real, command.shown)
        changed = True
        new_lines += regenerated(command.shown, real)
        print(f"{label}: updated the output of $ {first} (exit code {code})", file=sys.stderr)
    return new_lines if changed else None


def run_doctest(text: str, namespace: dict[str, object], label: str) -> None:
    parser = doctest.DocTestParser()
    test = parser.get_doctest(text, namespace, label, label, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    runner.run(test, out=report.append, clear_globs=False)
    if runner.failures:
        raise ExampleFailed("".join(report))


def serve() -> None:
    """Run the pages whose paths come on stdin, a line each, and answer each with a JSON line on
    stdout: ``{"blocks": N}``, or ``{"failed": "what differs"}``. What the pages themselves
    write to stdout goes to stderr. The tests run their pages through one such process per
    pytest worker (tests/docs/test_examples.py): torch is imported once, with NUMERIC_ENV."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        page = Path(line.strip())
        with tempfile.TemporaryDirectory(prefix="maskln-docs-") as folder:
            try:
                answer: dict[str, object] = {"blocks": run_page(page, Path(folder))}
            except ExampleFailed as failure:
                answer = {"failed": str(failure)}
            except Exception:  # the page's own code raised: say what, and go on
                answer = {"failed": traceback.format_exc()}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="default: every page")
    parser.add_argument("--update", action="store_true", help="rewrite console blocks' output")
    parser.add_argument("--serve", action="store_true", help="run the pages named on stdin")
    args = parser.parse_args(argv)
    if not pinned():  # torch reads NUMERIC_ENV when it is imported: run again with it set
        again = sys.argv[1:] if argv is None else argv
        command = [sys.executable, "-m", "tests.docs.runner", *again]
        return subprocess.run(command, env=pinned_environment(), cwd=ROOT).returncode
    if args.serve:
        serve()
        return 0
    failed = 0
    for page in [p.resolve() for p in args.pages] or pages():
        with tempfile.TemporaryDirectory(prefix="maskln-docs-") as folder:
            try:
                count = run_page(page, Path(folder), update=args.update)
                print(f"{page.relative_to(ROOT)}: {count} blocks ran", file=sys.stderr)
            except ExampleFailed as failure:
                failed += 1
                print(failure, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
