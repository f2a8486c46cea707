"""What a submission writes reaches no other submission's child, no later grade and no rules (issue
38, item 1): a module planted where a child would import it (gmpy2.py, which sympy tries when a
child first imports it: the second_order clause), a rules file planted beside the class, a
student's rules file beside their own file, and, for a grader run as root, the grader's
oom_score_adj and a writable cgroup hierarchy. Each attack is a submission of its own, graded by
real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.clitools import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl: Linux"),
]

WRONG = "from tests.solutions.mistakes import unbiased_variance as masked_layer_normalization\n"
CORRECT = "from tests.solutions.correct import masked_layer_normalization  # noqa: F401\n"
CLAUSES = ("--only", "values,second_order")


def grade(*args: object, cwd: Path, env: dict[str, str] | None = None):
    """``maskln grade ARGS`` as an instructor types it, from ``cwd``, the tests importable."""
    return subprocess.run(
        [str(Path(sys.executable).parent / "maskln"), "grade", *map(str, args)],
        capture_output=True, text=True, cwd=cwd, timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "300", **(env or {})},
    )  # fmt: skip


# --- a planted optional import -----------------------------------------------------------------

PLANTED = """
import gc, os, sys, types

with open(os.path.join({notes!r}, f"imported.{{os.getpid()}}"), "w") as note:
    note.write(" ".join(sys.argv))


def _right(x, valid, scale, bias, eps=1e-05):
    import torch

    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)


for found in gc.get_objects():  # the neighbour's function, made right
    if isinstance(found, types.FunctionType) and found.__name__ == "masked_layer_normalization":
        found.__code__ = _right.__code__
raise ImportError("no gmpy2 here: sympy goes on without it")
"""

PLANTER = """
import os
from tests.solutions.correct import masked_layer_normalization as correct

FOLDERS = {folders!r}
PLANTED = {planted!r}


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    for folder in (os.getcwd(), *FOLDERS):  # wherever a child might import from
        try:
            with open(os.path.join(folder, "gmpy2.py"), "w") as module:
                module.write(PLANTED)
        except OSError:
            pass
    return correct(x, valid, scale, bias, eps)
"""


def test_a_planted_optional_import_reaches_no_other_child_and_no_later_grade(tmp_path):
    """A submission writes gmpy2.py (not installed: sympy tries it when a child first imports
    sympy) into the current folder and the class folder; it swaps a correct function into
    whoever imports it. The class stops, naming the file; the wrong neighbour never passes, and
    graded alone later, from the same folder, it fails again: the planted module never runs."""
    work, folder, notes = tmp_path / "work", tmp_path / "work" / "class", tmp_path / "notes"
    folder.mkdir(parents=True)
    notes.mkdir()
    planted = PLANTED.format(notes=str(notes))
    (folder / "a_planter.py").write_text(
        PLANTER.format(folders=[str(work), str(folder)], planted=planted)
    )
    (folder / "b_wrong.py").write_text(WRONG)
    result = grade(folder, *CLAUSES, "--jobs", "1", "--json", cwd=work)
    assert (folder / "gmpy2.py").exists() and (work / "gmpy2.py").exists()  # the attack ran
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert not any(line["passed"] for line in lines if "b_wrong" in line["target"]), lines
    assert result.returncode == 2, result.stderr
    assert "gmpy2.py" in result.stderr, result.stderr
    # Later, the wrong file alone, from the folder holding the planted module:
    alone = grade("b_wrong.py", *CLAUSES, "--json", cwd=folder)
    report = json.loads(alone.stdout)
    assert not report["passed"] and report["root_cause"]["mistake"] == "unbiased_variance"
    assert alone.returncode == 1, alone.stderr
    assert sorted(p.name for p in notes.iterdir()) == []  # never imported by anyone


# --- a planted rules file ------------------------------------------------------------------------

RULES_PLANTER = """
import os
from tests.solutions.correct import masked_layer_normalization as correct


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    planted = os.path.join({folder!r}, "maskln-grade.toml")
    if not os.path.exists(planted):  # once: the next run is graded under it
        with open(planted, "w") as rules:
            rules.write({rules!r})
    return correct(x, valid, scale, bias, eps)
"""


@pytest.mark.parametrize("name", ["specification", "handout"])
def test_a_planted_rules_file_stops_the_class_and_never_grades_the_next_run_unseen(tmp_path, name):
    """A submission writes maskln-grade.toml beside the class (only signature counts). The
    class stops, naming it; the next run refuses a preset's name on other rules, and otherwise
    shows the rules' file and hash in every row, so a changed rule set is seen."""
    folder = tmp_path / "class"
    folder.mkdir()
    rules = f'required = ["signature"]\nname = "{name}"\n'
    (folder / "a_planter.py").write_text(RULES_PLANTER.format(folder=str(folder), rules=rules))
    (folder / "b_wrong.py").write_text(WRONG)
    result = grade(folder, "--only", "values", "--jobs", "1", "--json", cwd=tmp_path)
    assert (folder / "maskln-grade.toml").exists()  # the attack ran
    assert result.returncode == 2, result.stderr
    assert "maskln-grade.toml" in result.stderr, result.stderr
    later = grade(folder, "--jobs", "1", "--json", cwd=tmp_path)
    if name == "specification":
        assert later.returncode == 2 and later.stdout == ""
        assert "maskln-grade.toml" in later.stderr and "name" in later.stderr, later.stderr
        return
    lines = [json.loads(line) for line in later.stdout.splitlines()]
    assert lines and all(
        line["rules_source"].startswith(str(folder / "maskln-grade.toml")) for line in lines
    ), lines
    assert all("sha256 " in line["rules_source"] for line in lines)


# --- a student's rules beside their file -------------------------------------------------------


def test_a_students_rules_file_beside_their_file_is_never_read(tmp_path):
    """The instructor's pyproject.toml counts values; bob's maskln-grade.toml beside his file,
    named like the instructor's rules, counts only signature. Bob's wrong file fails under
    the instructor's rules, and the report says his file was not read."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.maskln.grade]\nrequired = ["signature", "values"]\nname = "week 3"\n'
    )
    bob = tmp_path / "students" / "bob"
    bob.mkdir(parents=True)
    (bob / "solution.py").write_text(WRONG)
    (bob / "maskln-grade.toml").write_text('required = ["signature"]\nname = "week 3"\n')
    result = grade(bob / "solution.py", "--json", cwd=tmp_path)
    report = json.loads(result.stdout)
    assert result.returncode == 1, result.stderr
    assert not report["passed"] and "values" in report["failed"]
    assert report["rules"] == "week 3"
    assert report["rules_source"].startswith(str(tmp_path / "pyproject.toml"))
    assert "students/bob/maskln-grade.toml" in result.stderr and "not read" in result.stderr


# --- a root child: the grader's oom_score_adj, cgroups, namespaces -----------------------------

ROOT_ATTACKER = """
import ctypes, os
from tests.solutions.correct import masked_layer_normalization as correct

NOTES = {notes!r}


def note(name, text):
    with open(os.path.join(NOTES, name), "a") as out:
        out.write(text + "\\n")


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    grader = os.getppid()
    try:
        with open(f"/proc/{{grader}}/oom_score_adj", "w") as adj:
            adj.write("1000")
        note("oom", "written")
    except OSError as error:
        note("oom refused", str(error))
    for hierarchy in ("freezer", "memory", "pids", "cpu"):
        try:
            with open(f"/sys/fs/cgroup/{{hierarchy}}/tasks", "w") as tasks:
                tasks.write(str(grader))
            note("cgroup", hierarchy)
        except OSError as error:
            note("cgroup refused", f"{{hierarchy}} {{error}}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000 | 0x00020000) == 0:  # a user and a mount namespace
        note("unshare", "done")
    else:
        note("unshare refused", os.strerror(ctypes.get_errno()))
    return correct(x, valid, scale, bias, eps)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the routes of a grader run as root")
def test_a_root_child_cannot_reach_the_graders_oom_score_adj_cgroups_or_namespaces(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    target = tmp_path / "attacker.py"
    target.write_text(ROOT_ATTACKER.format(notes=str(notes)))
    result = grade(target, "--only", "worked_example", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr  # it is correct otherwise
    written = sorted(p.name for p in notes.iterdir())
    assert "oom" not in written and "cgroup" not in written and "unshare" not in written, [
        (p.name, p.read_text()) for p in notes.iterdir()
    ]
    assert "oom refused" in written and "unshare refused" in written
