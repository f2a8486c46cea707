"""The grader against a hostile solution (issue 25, items 2, 3, 6, 7 and 11): files the grader
loads, changed by the solution, leave no verdict but FAIL; a deep chain of detached processes
dies with the grade; `grade | head -1` ends quietly; no __pycache__ beside the solution; a
memory bomb fails as out of memory, naming the limit; the output cap names itself. Real child
processes (a few seconds each)."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import time

import pytest

from maskln_cli.grading import guard
from maskln_cli.grading.runner import grade_target
from maskln_cli.grading.sandbox import CLAUSE_LIMIT
from tests.clitools import ROOT, grade_command, run

# In `make test-slow` (CI), not `make test`: hostile solutions in real grader processes.
pytestmark = pytest.mark.slow

SOLUTIONS = ROOT / "tests" / "solutions"
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc: Linux")
CORRECT = "from tests.solutions.correct import masked_layer_normalization as correct\n"


def test_a_file_the_grader_loaded_changed_by_the_solution_leaves_no_verdict(tmp_path, monkeypatch):
    """The solution changes (here: only the status of, so nothing else is disturbed) a module the
    grader has imported: code planted there would run in the grader. The grade fails, saying so,
    although every clause passed."""
    planted = tmp_path / "grader_module.py"
    planted.write_text("VALUE = 1\n")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the solution imports tests.solutions
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("grader_module")  # loaded by "the grader" before the seal
    path = tmp_path / "solution.py"
    path.write_text(
        CORRECT
        + f"import os\nos.chmod({str(planted)!r}, 0o644)\n"  # a ctime change, as a write makes
        + "masked_layer_normalization = correct\n"
    )
    with guard.sealing():
        report = grade_target(str(path), only=["worked_example"])
    assert [c.passed for c in report.clauses] == [True]
    assert not report.passed
    assert "the grader's own files changed while a submission ran" in report.problem
    assert str(planted) in report.problem
    assert report.verdict().startswith("FAIL: the grader's own files changed")
    sys.modules.pop("grader_module", None)


DEEP_CHAIN = (
    CORRECT
    + """
import os, time

def detach(level):
    # A double fork and setsid at each level, every process staying the parent of the next:
    # killing one level only orphans the next, 50 deep.
    if os.fork() != 0:
        return
    os.setsid()
    if os.fork() != 0:
        time.sleep(4)
        os._exit(0)
    with open(os.path.join({folder!r}, f"pid.{{level}}"), "w") as out:
        out.write(str(os.getpid()))
    if level < {depth}:
        detach(level + 1)
    time.sleep(4)  # outlive the grade, then write
    with open(os.path.join({folder!r}, f"late.{{level}}"), "w") as out:
        out.write("still alive")
    os._exit(0)

def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    detach(1)
    for _ in range(200):  # until the whole chain has started
        if os.path.exists(os.path.join({folder!r}, "pid.{depth}")):
            break
        time.sleep(0.02)
    return correct(x, valid, scale, bias, eps)
"""
)


@LINUX
def test_a_deep_chain_of_detached_processes_does_not_outlive_the_grade(tmp_path):
    folder = tmp_path / "chain"
    folder.mkdir()
    path = tmp_path / "solution.py"
    path.write_text(DEEP_CHAIN.format(folder=str(folder), depth=25))
    result = run("grade", path, "--only", "worked_example", "--json")
    assert result.returncode == 0, result.stderr
    pids = [int(p.read_text()) for p in folder.glob("pid.*")]
    assert len(pids) == 25  # the whole chain started
    time.sleep(5)  # past the chain's own sleep: a survivor would write now
    assert sorted(p.name for p in folder.glob("late.*")) == []
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), pid


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] == b"Z"
    except OSError:
        return True


@pytest.mark.parametrize("target", ["correct.py", "mistakes.py:unbiased_variance"])
def test_grade_piped_into_head_ends_quietly_with_its_verdict(target):
    command = [sys.executable, "-m", "maskln_cli", "grade", str(SOLUTIONS / target), "--only",
               "values"]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT) as p:
        assert p.stdout is not None and p.stderr is not None
        p.stdout.readline()
        p.stdout.close()  # as head -1 does
        stderr = p.stderr.read().decode()
        code = p.wait(120)
    assert stderr == ""
    assert code == (0 if target == "correct.py" else 1)


def test_no_bytecode_is_written_and_nothing_beside_the_solution_is_imported(tmp_path, monkeypatch):
    """No __pycache__ beside the solution; and a file beside it is not importable (the child
    imports the grader's private copy of the solution, alone: issue 38), while the packages
    PYTHONPATH names are."""
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    (tmp_path / "helper.py").write_text(CORRECT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    beside = "from helper import correct as masked_layer_normalization\n"
    for source, code in ((beside, 2), (f"{CORRECT}masked_layer_normalization = correct\n", 0)):
        path = tmp_path / "solution.py"
        path.write_text(source)
        result = subprocess.run(
            [sys.executable, "-m", "maskln_cli", "grade", str(path), "--only", "worked_example"],
            capture_output=True, cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)}, timeout=300,
        )  # fmt: skip
        assert result.returncode == code, result.stderr
        if code:
            assert b"No module named 'helper'" in result.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["helper.py", "solution.py"]


@LINUX
def test_a_memory_bomb_fails_as_out_of_memory_naming_the_cap(monkeypatch):
    monkeypatch.setenv("MASKLN_GRADE_MEMORY_GIB", "1")
    target = f"{SOLUTIONS / 'misbehaving.py'}:memory_bomb"
    result = grade_command(target, "--only", "worked_example", "--timeout", "3", "--json")
    assert result.exit_code == 1
    (clause,) = json.loads(result.stdout)["clauses"]
    assert clause["detail"].startswith("out of memory (cap 1 GiB, MASKLN_GRADE_MEMORY_GIB)")
    assert "timed out" not in clause["detail"]


def test_the_output_cap_says_it_is_the_graders_and_its_size():
    target = f"{SOLUTIONS / 'misbehaving.py'}:prints_too_much"
    result = grade_command(target, "--only", "worked_example", "--json")
    assert result.exit_code == 1
    (clause,) = json.loads(result.stdout)["clauses"]
    assert "it wrote more than the grader's cap of 64 MiB" in clause["detail"], clause["detail"]


HANGS = "from tests.solutions.misbehaving import hangs as masked_layer_normalization\n"
CALL_LIMIT = re.compile(
    r"timed out after (?P<seconds>[0-9.]+) s in the case .* \(the function hung, or is that"
    r" slow: a call may take 10000 times what maskln's op takes on its case, or 25 times a"
    r" Python loop over its rows, at least 5 s;"
    r" --timeout SECONDS gives each clause one limit instead\)"
)


def call_limit(detail: str) -> float:
    """The limit a call ran out of (at least 5 s: 10,000 times maskln's op on that case, which
    the raw-op backend or a loaded machine makes slower; a clause's limit at most), or fail."""
    found = CALL_LIMIT.fullmatch(detail)
    assert found, detail
    return float(found["seconds"])


def test_a_hanging_function_fails_in_seconds_each_call_timed_against_the_op():
    """Without --timeout each call may take 10000 times what maskln's op takes on its case (timed
    in the same child), at least 5 s: a hang fails its first two clauses in seconds each, then
    the rest are not run (it was two minutes: two clauses of 60 s)."""
    started = time.monotonic()
    result = grade_command(f"{SOLUTIONS / 'misbehaving.py'}:hangs", "--json")
    seconds = time.monotonic() - started
    assert result.exit_code == 1, result.stderr
    first, second, *rest = json.loads(result.stdout)["clauses"]
    for clause in (first, second):
        assert 5 <= call_limit(clause["detail"]) <= CLAUSE_LIMIT
    assert "[worked example]" in second["detail"]
    assert all(c["detail"].startswith("not run: the function crashed or hung") for c in rest)
    assert seconds < 120  # a guard against a hang, not a speed test


def test_a_hang_costs_a_class_seconds_and_an_explicit_timeout_means_the_clause(tmp_path):
    (tmp_path / "a_hangs.py").write_text(HANGS)
    (tmp_path / "b_correct.py").write_text(
        "from tests.solutions.correct import masked_layer_normalization  # noqa: F401\n"
    )
    only = ("--only", "worked_example,values", "--jobs", "1", "--json")
    for timeout in (None, "3"):
        options = ("--timeout", timeout) if timeout else ()
        result = run("grade", tmp_path, *only, *options)
        assert result.returncode == 1, result.stderr
        hangs, correct = (json.loads(line) for line in result.stdout.decode().splitlines())
        assert correct["passed"]
        details = [c["detail"] for c in hangs["clauses"]]
        if timeout is None:
            assert all(5 <= call_limit(detail) <= CLAUSE_LIMIT for detail in details)
        else:  # the whole clause's limit, as --timeout always meant
            assert [d.startswith("timed out after 3 s in the case ") for d in details] == [True] * 2
            assert all(d.endswith("(the function hung, or is that slow)") for d in details)
