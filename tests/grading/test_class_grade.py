"""maskln grade of a whole class (issue 22): several TARGETs (files, a folder, module targets),
each in its own processes, --jobs at a time; a hanging or crashing submission costs only its
own time limit; a table, JSON lines, a CSV gradebook; exit 1 when any fails; --shard K/N slices
that concatenate into the whole report. Real worker processes (one run, shared by the tests)."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maskln_cli.files.slices import shard_of
from maskln_cli.grading.targets import expand_targets
from tests.clitools import ROOT, assert_one_line_error, invoke, run

# In `make test-slow` (CI), not `make test`: whole classes graded by real processes.
pytestmark = pytest.mark.slow

HANGS = """
import time

def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    while True:
        time.sleep(0.01)
"""
CRASHES = """
import os

def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    os._exit(3)
"""
CORRECT = "from tests.solutions.correct import masked_layer_normalization  # noqa: F401\n"
WRONG = "from tests.solutions.mistakes import unbiased_variance as masked_layer_normalization\n"
ONLY = ("--only", "worked_example,values")


@pytest.fixture(scope="module")
def classroom(tmp_path_factory):
    folder = tmp_path_factory.mktemp("class")
    for name, source in [("a_hangs", HANGS), ("b_crashes", CRASHES), ("c_correct", CORRECT),
                         ("d_wrong", WRONG), ("_helper", "")]:  # fmt: skip
        (folder / f"{name}.py").write_text(source)
    return folder


@pytest.fixture(scope="module")
def graded(classroom, tmp_path_factory):
    """One class run: the folder and a module target, JSON lines and a gradebook. As a real
    process: a sealed grader checks every file it has loaded, and a test worker has loaded many
    that other workers write (bytecode, temporary files)."""
    gradebook = tmp_path_factory.mktemp("out") / "gradebook.csv"
    started = time.monotonic()
    module = "tests.solutions.correct:masked_layer_normalization"
    options = ("--timeout", "2", "--jobs", "3", "--json", "--csv", gradebook)
    result = run("grade", classroom, module, *ONLY, *options)
    return result, gradebook, time.monotonic() - started


def test_a_class_with_a_hanging_a_crashing_and_a_correct_submission(classroom, graded):
    result, _, seconds = graded
    assert result.returncode == 1, result.stdout + result.stderr
    lines = [json.loads(line) for line in result.stdout.decode().splitlines()]
    by_target = {line["target"]: line for line in lines}
    assert list(by_target) == sorted(by_target)  # one object per submission, in target order
    assert len(lines) == 5  # _helper.py is not a submission
    hangs = by_target[str(classroom / "a_hangs.py")]
    assert not hangs["passed"]
    assert hangs["clauses"][0]["detail"].startswith("timed out after 2 s in the case")
    crashes = by_target[str(classroom / "b_crashes.py")]
    assert not crashes["passed"]
    assert "exited with code 3" in crashes["clauses"][0]["detail"]
    assert by_target[str(classroom / "c_correct.py")]["passed"]
    assert by_target["tests.solutions.correct:masked_layer_normalization"]["passed"]
    wrong = by_target[str(classroom / "d_wrong.py")]
    assert wrong["root_cause"]["mistake"] == "unbiased_variance"
    # The hang costs its own time limits (2 clauses x (2 s + the kill's grace)), not the class's.
    assert seconds < 120


def test_the_gradebook_has_a_row_per_submission_and_a_column_per_clause(classroom, graded):
    _, gradebook, _ = graded
    rows = list(csv.reader(gradebook.open(newline="")))
    assert rows[0] == ["submission", "verdict", "passed", "counted", "failed", "root_cause", "why",
                       "rules", "rules_source", "op", "worked_example", "values"]  # fmt: skip
    verdicts = {row[0]: row[1] for row in rows[1:]}
    assert verdicts == {  # relative to the folder graded (issue 32)
        "a_hangs.py": "FAIL",
        "b_crashes.py": "FAIL",
        "c_correct.py": "PASS",
        "d_wrong.py": "FAIL",
        "tests.solutions.correct:masked_layer_normalization": "PASS",
    }
    wrong = next(row for row in rows if row[0].endswith("d_wrong.py"))
    assert wrong[5] == "unbiased_variance" and wrong[9:] == ["layer", "fail", "fail"]


def test_the_table_has_a_row_per_submission_and_the_root_cause(classroom):
    result = run("grade", classroom / "c_correct.py", classroom / "d_wrong.py", *ONLY)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.decode().splitlines()
    assert lines[0] == f"maskln grade: 2 submissions in {classroom}"
    row = next(line for line in lines if line.startswith("d_wrong.py"))  # relative (issue 32)
    assert "FAIL" in row
    assert lines[lines.index(row) + 1] == "    unbiased variance (divides by C - 1)"
    assert any(line.startswith("c_correct.py") and "PASS" in line for line in lines)
    assert lines[-1] == "FAIL: 1 of 2 submissions pass, 1 fail"  # counts, not paths


def test_shards_are_deterministic_slices_that_concatenate_into_the_whole():
    targets = [f"s{i:02}.py" for i in range(11)]
    slices = [shard_of(targets, (k, 4)) for k in range(1, 5)]
    assert [t for part in slices for t in part] == targets
    assert all(2 <= len(part) <= 3 for part in slices)


def test_a_shard_grades_its_slice_of_the_sorted_targets(classroom):
    expected = shard_of(expand_targets([str(classroom)]), (2, 2))
    result = run("grade", classroom, "--shard", "2/2", "--only", "signature", "--json")
    assert result.returncode == 1, result.stderr  # d_wrong.py fails its signature
    lines = result.stdout.decode().splitlines()
    assert [json.loads(line)["target"] for line in lines] == expected


def test_class_usage_errors_are_one_line(classroom, tmp_path):
    result = invoke("grade", classroom, "--shard", "3/2")
    assert result.exit_code == 2
    assert_one_line_error(
        result.stderr, "--shard '3/2': give K/N, the K-th of N slices, 1 <= K <= N (e.g. 3/8)"
    )
    target = classroom / "c_correct.py"
    before = target.read_bytes()
    result = invoke("grade", target, classroom / "d_wrong.py", "--csv", target)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, str(target))
    assert target.read_bytes() == before
    empty = tmp_path / "empty"
    empty.mkdir()
    result = invoke("grade", empty)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "a folder with no .py file to grade")


def _wait_for_a_worker(parent: int, seconds: float = 60) -> None:
    """Until a grading worker runs under ``parent`` (read from /proc; a fixed sleep can end
    before the grade has started on a loaded machine)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                status = (entry / "status").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            ppid = next(
                (line.split()[1] for line in status.splitlines() if line.startswith("PPid:")), ""
            )
            if ppid == str(parent) and b"maskln_cli.grading.worker" in cmdline:
                return
        time.sleep(0.1)
    raise AssertionError(f"no grading worker started under {parent} in {seconds} s")


def test_ctrl_c_stops_a_class_cleanly_with_what_was_graded(classroom):
    targets = [str(classroom / "a_hangs.py"), str(classroom / "c_correct.py")]
    options = ["--timeout", "60", "--jobs", "1", "--json"]
    command = [sys.executable, "-m", "maskln_cli", "grade", *targets, *options]
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        # A terminal's Ctrl-C: SIGINT not ignored. An ignored SIGINT is inherited (and rightly
        # kept by the grader), as under pytest-xdist's workers or a script's background job.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ) as p:
        _wait_for_a_worker(p.pid)  # on a loaded machine start-up alone may take seconds
        time.sleep(3)  # the first submission hangs in its first clause
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 130, stderr
    assert b"Traceback" not in stderr and b"discarded" not in stderr
    assert stdout == b""  # nothing was graded yet: no line is made up
