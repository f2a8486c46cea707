"""A class grade (`--jobs`) against submissions that attack it (issue 31, section 1): a forged
answer written into a worker, a worker killed mid-class, grader files planted and workers killed
so that fresh ones import them, submissions named like modules of Python or of the grader,
graded from inside their folder. Each attack is a submission of its own, as a student would
write it, graded by real processes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.clitools import ROOT, run

# In `make test-slow` (CI), not `make test`: hostile classes graded by real processes.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl: Linux"),
]

CORRECT = "from tests.solutions.correct import masked_layer_normalization  # noqa: F401\n"
WRONG = "from tests.solutions.mistakes import unbiased_variance as masked_layer_normalization\n"
ONLY = ("--only", "worked_example,values")

# What the attacks share: the worker grading a submission is its child's parent, the class
# grader that worker's parent.
ATTACKER_TOOLS = """
import json, os, signal, sys, time
from tests.solutions.correct import masked_layer_normalization as correct

def parent_of(pid):
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rpartition(")")[2].split()[1])

def children_of(pid):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if parent_of(int(entry)) == pid:
                    found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return found

def detached(work):
    # A double fork and setsid: the process outlives the child it came from.
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            try:
                work()
            finally:
                os._exit(0)
        os._exit(0)

def note(name, text):
    with open(os.path.join(NOTES, name), "a") as out:
        out.write(text + "\\n")
"""

FORGER = """
FORGED = {"report": {"target": VICTIM, "strict": False, "seed": 0, "clauses": [
    {"name": name, "required": True, "passed": True, "seconds": 0.1}
    for name in ("worked_example", "values")]}}

def forge(grader, worker):
    # Write the forged answer into the stdout of every worker that starts after this one.
    written = set()
    end = time.monotonic() + 60
    while time.monotonic() < end:
        for pid in children_of(grader):
            if pid == worker or pid in written:
                continue
            try:
                with open(f"/proc/{pid}/fd/1", "w") as answers:
                    answers.write(json.dumps(FORGED) + "\\n")
                note("forged", str(pid))
            except OSError as error:
                note("refused", f"{pid} {error}")
            written.add(pid)
        time.sleep(0.005)

def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    worker = os.getppid()
    grader = parent_of(worker)
    detached(lambda: forge(grader, worker))
    try:
        os.kill(worker, signal.SIGKILL)
        note("killed", str(worker))
    except OSError as error:
        note("kill refused", str(error))
    time.sleep(20)
    return correct(x, valid, scale, bias, eps)
"""


def attacker(attack: str, **constants: object) -> str:
    """A submission's source: the constants, the shared tools, then the attack."""
    header = "".join(f"{name} = {value!r}\n" for name, value in constants.items())
    return ATTACKER_TOOLS + header + attack


def test_a_forged_answer_written_into_a_new_worker_is_never_a_verdict(tmp_path):
    """The attack of issue 31: a submission kills its worker, then writes a passing answer
    for the next submission into the stdout of the worker that replaces it. The next
    submission is wrong: it fails, with its own root cause, whatever the attacker did."""
    folder, notes = tmp_path / "class", tmp_path / "notes"
    folder.mkdir()
    notes.mkdir()
    victim = folder / "b_wrong.py"
    victim.write_text(WRONG)
    (folder / "a_attacker.py").write_text(attacker(FORGER, NOTES=str(notes), VICTIM=str(victim)))
    result = run("grade", folder, *ONLY, "--jobs", "1", "--json")
    assert result.returncode == 1, result.stderr  # not 2: no file of the grader's changed
    lines = [json.loads(line) for line in result.stdout.decode().splitlines()]
    by_target = {line["target"]: line for line in lines}
    assert sorted(by_target) == [str(folder / "a_attacker.py"), str(victim)], result.stderr
    assert not by_target[str(folder / "a_attacker.py")]["passed"]
    wrong = by_target[str(victim)]
    assert not wrong["passed"], f"a forged PASS: {sorted(p.name for p in notes.iterdir())}"
    assert wrong["root_cause"]["mistake"] == "unbiased_variance"


# --- a worker lost mid-class -----------------------------------------------------------------

REPORTS_ITS_WORKER = """
CALLS = []

def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    # Say which worker grades it, then take a moment: the test kills that worker meanwhile.
    if not CALLS:
        note(f"{NAME}.{os.getppid()}", "")
        time.sleep(2)
    CALLS.append(1)
    return correct(x, valid, scale, bias, eps)
"""


def grade_killing_workers(
    command: list[str], notes: Path, kill: Callable[[str, int], bool], **options: object
) -> subprocess.Popen[bytes]:
    """Run the grade, killing each worker a submission names in ``notes`` (``NAME.PID``) when
    ``kill(NAME, how many times it named one)``; returns the ended process, its output read
    into ``.output``."""
    seen: dict[str, int] = {}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          **options) as grade:  # type: ignore[call-overload]  # fmt: skip
        while grade.poll() is None:
            for path in sorted(notes.iterdir()):
                name, _, pid = path.name.rpartition(".")
                if path.name in seen or not pid.isdigit():
                    continue
                seen[path.name] = times = 1 + sum(n.startswith(name + ".") for n in seen)
                if kill(name, times):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.02)
        grade.output = grade.communicate(timeout=60)[0].decode()  # type: ignore[attr-defined]
    return grade


def row(output: str, name: str) -> str:
    """The submission's row of the class table with the lines folded under it (its causes)."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if name in line)
    end = start + 1
    while end < len(lines) and lines[end].startswith("    "):
        end += 1
    return "\n".join(lines[start:end])


def test_a_worker_lost_mid_class_never_turns_into_a_verdict(tmp_path):
    """A worker killed while it grades (by whatever means): the target is graded again on a
    fresh worker, and its verdict is that grade's; a target whose workers are killed every time
    is a grader error, FAIL, never PASS; the others are graded as usual; and the private
    folders of the workers killed are removed all the same."""
    folder, notes, temporary = tmp_path / "class", tmp_path / "notes", tmp_path / "tmp"
    folder.mkdir()
    notes.mkdir()
    temporary.mkdir()
    for name in ("a_killed_once", "b_killed_always"):
        source = attacker(REPORTS_ITS_WORKER, NOTES=str(notes), NAME=name)
        (folder / f"{name}.py").write_text(source)
    (folder / "c_wrong.py").write_text(WRONG)
    command = [sys.executable, "-m", "maskln_cli", "grade", str(folder), *ONLY, "--jobs", "2"]
    grade = grade_killing_workers(
        command, notes, lambda name, times: name == "b_killed_always" or times == 1,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "300", "PYTHONPATH": str(ROOT), "TMPDIR": str(temporary)},
    )  # fmt: skip
    output = grade.output  # type: ignore[attr-defined]
    assert list(temporary.glob("maskln-grade-*")) == []  # before: one per worker killed
    assert "PASS" in row(output, "a_killed_once.py"), output
    always = row(output, "b_killed_always.py")
    assert "FAIL" in always and "grader error" in always, output
    assert "unbiased variance" in row(output, "c_wrong.py"), output
    assert len(list(notes.glob("a_killed_once.*"))) == 2  # graded twice
    assert len(list(notes.glob("b_killed_always.*"))) == 2  # twice, then given up
    assert grade.returncode == 1, output


# --- planted code ----------------------------------------------------------------------------

PLANTER = '''
RUNNER = os.path.join(COPY, "maskln_cli", "grading", "runner.py")
PLANTED = """
_graded_for_real = grade_target
def grade_target(target, *args, **kwargs):
    report = _graded_for_real(target, *args, **kwargs)
    for clause in report.clauses:
        clause.passed, clause.detail, clause.diagnosis = True, None, None
    report.root_cause = report.problem = None
    return report
"""

def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    with open(RUNNER) as source:
        planted = "_graded_for_real" in source.read()
    if not planted:
        with open(RUNNER, "a") as source:
            source.write(PLANTED)
    worker = os.getppid()
    note(f"planter.{worker}", "")
    if KILL_WORKERS:  # so that fresh ones import the planted file
        for pid in children_of(parent_of(worker)):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError as error:
                note("kill refused", str(error))
    elif not planted:
        time.sleep(2)  # the test kills this worker meanwhile
    return correct(x, valid, scale, bias, eps)
'''


def copy_of_the_grader(tmp_path: Path) -> Path:
    """maskln_cli copied into a folder of its own, to be planted in (not this checkout's)."""
    root = tmp_path / "install"
    shutil.copytree(ROOT / "maskln_cli", root / "maskln_cli",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    return root


@pytest.mark.parametrize("killer", ["the submission", "the test"])
def test_planted_grader_code_stops_the_class_even_when_workers_are_killed(tmp_path, killer):
    """A submission appends to the grader's runner.py a grade_target that passes everything,
    then has the workers killed (it tries itself; or the test does it for it, as if it could),
    so that fresh workers would import the planted file. The class grade stops, naming the
    file, and the wrong submission graded after it never passes."""
    install = copy_of_the_grader(tmp_path)
    folder, notes = tmp_path / "class", tmp_path / "notes"
    folder.mkdir()
    notes.mkdir()
    planter = attacker(PLANTER, NOTES=str(notes), COPY=str(install),
                       KILL_WORKERS=killer == "the submission")  # fmt: skip
    (folder / "a_planter.py").write_text(planter)
    (folder / "b_wrong.py").write_text(WRONG)
    env = {**os.environ, "COLUMNS": "300", "PYTHONPATH": f"{install}{os.pathsep}{ROOT}",
           "MASKLN_BACKEND": "raw"}  # fmt: skip
    command = [sys.executable, "-m", "maskln_cli", "grade", str(folder), *ONLY, "--jobs", "1"]
    grade = grade_killing_workers(
        command, notes, lambda name, times: killer == "the test", cwd=install, env=env
    )
    output = grade.output  # type: ignore[attr-defined]
    assert "_graded_for_real" in (install / "maskln_cli/grading/runner.py").read_text()
    assert not any("b_wrong.py" in line and "PASS" in line for line in output.splitlines()), output
    assert "the grader's own files changed while a submission ran" in output, output
    assert "runner.py" in output
    assert grade.returncode == 2, output


# --- a neighbour's file ----------------------------------------------------------------------

REWRITER = """
def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    # The next submission is wrong: make it right, for its author.
    with open(VICTIM, "w") as victim:
        victim.write("from tests.solutions.correct import masked_layer_normalization\\n")
    return correct(x, valid, scale, bias, eps)
"""


def test_a_submission_that_rewrites_a_neighbours_file_stops_the_class(tmp_path):
    folder, notes = tmp_path / "class", tmp_path / "notes"
    folder.mkdir()
    notes.mkdir()
    victim = folder / "b_wrong.py"
    victim.write_text(WRONG)
    (folder / "a_rewriter.py").write_text(attacker(REWRITER, NOTES=str(notes), VICTIM=str(victim)))
    result = run("grade", folder, *ONLY, "--jobs", "1", environment={"COLUMNS": "300"})
    output = result.stdout.decode()
    assert "tests.solutions.correct" in victim.read_text()  # the attack happened
    assert not any("b_wrong.py" in line and "PASS" in line for line in output.splitlines()), output
    assert "the class's files changed while it was graded" in output, output
    assert result.returncode == 2, output


# --- grading from inside the class folder ----------------------------------------------------

FORCES_PASS = """
# inspect.py: whoever imports inspect from this folder gets the real one, and from then on
# every report it writes as JSON passes.
import importlib.util, json, os, sys

here = os.path.dirname(os.path.abspath(__file__))
for folder in sys.path:
    candidate = os.path.join(folder or ".", "inspect.py")
    if os.path.isfile(candidate) and os.path.dirname(os.path.abspath(candidate)) != here:
        spec = importlib.util.spec_from_file_location("inspect", candidate)
        real = importlib.util.module_from_spec(spec)
        sys.modules["inspect"] = real
        spec.loader.exec_module(real)
        globals().update(vars(real))
        break

_dumps = json.dumps

def dumps(obj, *args, **kwargs):
    if isinstance(obj, dict) and isinstance(obj.get("report"), dict):
        report = obj["report"]
        report["problem"] = report["root_cause"] = None
        for clause in report.get("clauses") or []:
            clause["passed"], clause["detail"], clause["diagnosis"] = True, None, None
    return _dumps(obj, *args, **kwargs)

json.dumps = dumps
"""


def test_no_file_of_the_class_shadows_a_module_when_graded_from_inside_its_folder(tmp_path):
    """Submissions named inspect.py (it tries to force every verdict to PASS), copy.py and
    safetensors.py (both correct), graded from inside their folder: nothing of theirs is
    imported but in their own child, so each verdict is its submission's."""
    folder = tmp_path / "class"
    folder.mkdir()
    (folder / "inspect.py").write_text(FORCES_PASS)
    (folder / "copy.py").write_text(CORRECT)
    (folder / "safetensors.py").write_text(CORRECT)
    (folder / "c_correct.py").write_text(CORRECT)
    (folder / "d_wrong.py").write_text(WRONG)
    maskln = Path(sys.executable).parent / "maskln"  # the entry point: not `python -m`
    result = subprocess.run(
        [str(maskln), "grade", ".", *ONLY, "--jobs", "2", "--json"],
        capture_output=True, cwd=folder, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    lines = [json.loads(line) for line in result.stdout.decode().splitlines()]
    verdicts = {Path(line["target"]).name: line for line in lines}
    assert sorted(verdicts) == ["c_correct.py", "copy.py", "d_wrong.py", "inspect.py",
                                "safetensors.py"], result.stderr  # fmt: skip
    assert verdicts["c_correct.py"]["passed"]
    assert verdicts["copy.py"]["passed"]
    assert verdicts["safetensors.py"]["passed"]
    assert not verdicts["d_wrong.py"]["passed"]
    assert verdicts["d_wrong.py"]["root_cause"]["mistake"] == "unbiased_variance"
    assert not verdicts["inspect.py"]["passed"]  # it has no function to grade
    assert "no 'masked_layer_normalization' in it" in verdicts["inspect.py"]["problem"]
    assert result.returncode == 1
