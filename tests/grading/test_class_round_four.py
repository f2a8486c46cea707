"""A class of 42 fresh solutions graded in one command (issue 38's done-when):
tests/solutions/class_round_four/, 8 correct in styles new to the catalogue and 34 wrong with one
mistake each that no earlier catalogue holds, 25 of them living in a data family (C = 1 or 2,
rows of zeros, one valid row, every row valid, exact ties, magnitudes, a tiny eps, the identity
affine, no rows) or in torch's global state (threads, grad mode, autocast, inference mode,
matmul precision, denormals, warnings, the random stream, deterministic algorithms and anomaly
mode set off "back"). Every wrong one is wrong by the independent float64 checker
(tests/grading/independent_checker.py) and every correct one right by it; the grader then passes
exactly the correct ones, and every report and gradebook row names the rules' file and hash.
Slow: every submission in processes of its own, two at a time."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.clitools import ROOT
from tests.grading.classes import load_module, submission, submissions
from tests.grading.independent_checker import check

pytestmark = pytest.mark.slow

CLASS = ROOT / "tests" / "solutions" / "class_round_four"


_EXPECTED = load_module(CLASS / "_expected.py", "class_round_four_expected")
EXPECTED = _EXPECTED.EXPECTED


def test_the_class_is_the_manifest():
    files = submissions(CLASS)
    assert files == sorted(EXPECTED)
    assert len(files) >= 40
    wrong = {name: kind for name, kind in EXPECTED.items() if kind}
    living = [n for n, (where, _) in wrong.items() if where in (_EXPECTED.FAMILY, _EXPECTED.STATE)]
    assert len(living) >= len(wrong) / 2, living


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_independent_checker_agrees_with_the_instructor(name):
    """Wrong established apart from the grader: a float64 loop reference, finite differences,
    the checker's own data, families and state readers, and looser tolerances."""
    found = check(submission(CLASS, name, "class_round_four").masked_layer_normalization)
    if EXPECTED[name] is None:
        assert found == [], found
    else:
        assert found, f"{name} should be wrong, and the checker finds nothing wrong"


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """One real run, as an instructor types it (the rules found beside the submissions)."""
    gradebook = tmp_path_factory.mktemp("class") / "gradebook.csv"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "maskln_cli", "grade", str(CLASS), "--json", "--csv",
         str(gradebook)],
        capture_output=True, cwd=ROOT, timeout=3600,
    )  # fmt: skip
    result = SimpleNamespace(
        exit_code=done.returncode, stdout=done.stdout.decode(), stderr=done.stderr.decode()
    )
    return result, gradebook, time.monotonic() - started


def _reports(result) -> dict[str, dict]:
    return {Path(line["target"]).name: line for line in map(json.loads, result.stdout.splitlines())}


def test_one_command_grades_the_class_with_no_false_pass_and_no_false_fail(graded):
    result, _, seconds = graded
    assert result.exit_code == 1, result.stderr  # some fail, as they should
    reports = _reports(result)
    assert sorted(reports) == sorted(EXPECTED)
    false_passes = [n for n, r in reports.items() if r["passed"] and EXPECTED[n] is not None]
    false_fails = [n for n, r in reports.items() if not r["passed"] and EXPECTED[n] is None]
    assert false_passes == [] and false_fails == [], (false_passes, false_fails)
    print(f"\n{len(reports)} submissions graded in {seconds:.0f} s")


def test_every_report_and_gradebook_row_names_the_rules_file_and_its_hash(graded):
    result, gradebook, _ = graded
    reports = _reports(result)
    source = f"{CLASS / 'maskln-grade.toml'}, sha256 "
    assert all(r["rules_source"].startswith(source) for r in reports.values())
    rows = list(csv.DictReader(gradebook.open(newline="")))
    assert [row["submission"] for row in rows] == sorted(EXPECTED)
    for row in rows:
        report = reports[row["submission"]]
        assert row["verdict"] == ("PASS" if report["passed"] else "FAIL")
        assert row["rules_source"] == report["rules_source"]
