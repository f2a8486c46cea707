"""Helpers for driving the command line: in-process (Typer's CliRunner) and as a real process."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from maskln_cli.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_data"
WORKED = SAMPLES / "worked_example.safetensors"
PAIRS = SAMPLES / "pair_features.safetensors"


def invoke(*args: object, input: bytes | None = None):
    """Run ``maskln ARGS`` in this process; returns Typer's Result (stdout, stderr, exit_code)."""
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def run(
    *args: object,
    stdin=None,
    input: bytes | None = None,
    environment: dict[str, str] | None = None,
    **kwargs,
) -> subprocess.CompletedProcess:
    """Run the real entry point (``python -m maskln_cli ARGS``) in a subprocess; ``environment``
    adds to (or overrides) this process's variables. The checkout is on ``PYTHONPATH``: a
    submission a test writes may import the suite's solutions (``tests.solutions``), as a
    graded file may import what ``PYTHONPATH`` holds, never what the current folder does."""
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kwargs}
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "maskln_cli", *map(str, args)],
        stdin=stdin,
        input=input,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200", "PYTHONPATH": path, **(environment or {})},
        timeout=300,
        **streams,
    )


def grade_command(*args: object) -> SimpleNamespace:
    """``maskln grade ARGS`` as a real process (``exit_code``, ``stdout``, ``stderr`` as text): a
    grade seals its process and checks every file it has loaded, and a test worker has loaded
    many files that other workers write meanwhile (bytecode, temporary files)."""
    done = run("grade", *args)
    return SimpleNamespace(
        exit_code=done.returncode, stdout=done.stdout.decode(), stderr=done.stderr.decode()
    )


def run_without_torch_check(*args: object) -> SimpleNamespace:
    """``maskln ARGS`` through ``main()`` in a fresh Python, which then reports whether the
    command imported torch: ``exit_code`` (SystemExit's code, None when main returned),
    ``torch_imported``, and ``stdout`` and ``stderr`` as text (the report line taken off)."""
    probe = (
        "import sys\n"
        "from maskln_cli.cli import main\n"
        f"sys.argv = ['maskln', *{[str(a) for a in args]!r}]\n"
        "code = None\n"
        "try:\n    main()\nexcept SystemExit as end:\n    code = end.code\n"
        "print('probe', repr(code), 'torch' in sys.modules, file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    stderr, _, report = result.stderr.rstrip("\n").rpartition("\n")
    if not report.startswith("probe "):  # the probe died before its report: show why
        raise AssertionError(result.stderr)
    code, _, imported = report.removeprefix("probe ").rpartition(" ")
    return SimpleNamespace(
        exit_code=ast.literal_eval(code),
        torch_imported=imported == "True",
        stdout=result.stdout,
        stderr=stderr,
    )


def write(path: Path, tensors: dict[str, torch.Tensor], **metadata: str) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata or None)
    return path


def read(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as handle:
        return dict(handle.metadata() or {})


def assert_one_line_error(stderr: str | bytes, *fragments: str) -> None:
    """stderr is exactly one line, 'maskln: error: ...', holding every fragment; no traceback."""
    text = stderr.decode() if isinstance(stderr, bytes) else stderr
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert lines[0].startswith("maskln: error: "), text
    assert "Traceback" not in text
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def leftovers(folder: Path) -> list[str]:
    """Temporary files an interrupted write could leave behind."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def writing_into(pid: int, folder: Path) -> bool:
    """Whether process ``pid`` has a file in ``folder`` open for writing: an output being
    written, anonymous (``#123 (deleted)``) or hidden (``.NAME.HEX.partial``)."""
    try:
        entries = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for entry in entries:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{entry}")
            flags = int(Path(f"/proc/{pid}/fdinfo/{entry}").read_text().split()[3], 8)
        except (OSError, ValueError, IndexError):
            continue
        if os.path.dirname(target) == str(folder) and flags & (os.O_WRONLY | os.O_RDWR):
            return True
    return False
