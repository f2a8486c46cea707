"""A class of 68 fresh solutions graded in one command (issue 32's done-when):
tests/solutions/class_round_three/, 22 correct in varied styles and 46 wrong with one realistic
mistake each, graded with the rules beside them (maskln-grade.toml: the specification's clauses,
+0.0 and second derivatives). Every wrong one is wrong by an independent float64 checker
(tests/grading/independent_checker.py) and every correct one right by it; the grader then
passes exactly the correct ones, its gradebook agrees with each submission's verdict and names
the rules, and its leading cause agrees with the instructor's (_expected.py) for at least 9 in
10 of the wrong ones. Slow: every submission in processes of its own, two at a time."""

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

CLASS = ROOT / "tests" / "solutions" / "class_round_three"


EXPECTED: dict[str, tuple[str, ...] | None] = load_module(
    CLASS / "_expected.py", "class_round_three_expected"
).EXPECTED


def _function(name: str):
    return submission(CLASS, name, "class_round_three").masked_layer_normalization


def test_the_class_is_the_manifest():
    files = submissions(CLASS)
    assert files == sorted(EXPECTED)
    assert len(files) >= 60
    wrong = [name for name, cause in EXPECTED.items() if cause]
    assert len(wrong) >= 40 and len(files) - len(wrong) >= 20


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_independent_checker_agrees_with_the_instructor(name):
    """Wrong established apart from the grader: a float64 loop reference, finite differences,
    the checker's own data and looser tolerances."""
    found = check(_function(name))
    if EXPECTED[name] is None:
        assert found == [], found
    else:
        assert found, f"{name} should be wrong, and the checker finds nothing wrong"


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """One real run, as an instructor types it (the rules found beside the submissions). Its
    wall time is the machine's: about 4 to 20 minutes on 2 cores, with or without a load."""
    gradebook = tmp_path_factory.mktemp("class") / "gradebook.csv"
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "maskln_cli",
            "grade",
            str(CLASS),
            "--json",
            "--csv",
            str(gradebook),
        ],
        capture_output=True,
        cwd=ROOT,
        timeout=3600,
    )
    result = SimpleNamespace(
        exit_code=done.returncode, stdout=done.stdout.decode(), stderr=done.stderr.decode()
    )
    return result, gradebook, time.monotonic() - started


def test_one_command_grades_the_class_with_no_false_pass_and_no_false_fail(graded):
    result, _, seconds = graded
    assert result.exit_code == 1, result.stderr  # some fail, as they should
    reports = {
        Path(line["target"]).name: line for line in map(json.loads, result.stdout.splitlines())
    }
    assert sorted(reports) == sorted(EXPECTED)
    false_passes = [n for n, r in reports.items() if r["passed"] and EXPECTED[n] is not None]
    false_fails = [n for n, r in reports.items() if not r["passed"] and EXPECTED[n] is None]
    assert false_passes == [] and false_fails == [], (false_passes, false_fails)
    rules = {r["rules"] for r in reports.values()}
    assert rules == {"handout: specification + positive_zero, second_order"}
    for report in reports.values():  # the rules' extra clauses were counted
        counted = {c["name"] for c in report["clauses"] if c["counted"]}
        assert {"positive_zero", "second_order"} <= counted
    print(f"\n{len(reports)} submissions graded in {seconds:.0f} s")


def test_the_gradebook_agrees_with_each_verdict_and_names_the_rules(graded):
    result, gradebook, _ = graded
    reports = {
        Path(line["target"]).name: line for line in map(json.loads, result.stdout.splitlines())
    }
    rows = list(csv.DictReader(gradebook.open(newline="")))
    assert [row["submission"] for row in rows] == sorted(EXPECTED)  # relative to the folder
    for row in rows:
        report = reports[row["submission"]]
        assert row["verdict"] == ("PASS" if report["passed"] else "FAIL")
        assert row["failed"].split() == report["failed"]
        assert row["root_cause"] == ((report["root_cause"] or {}).get("mistake") or "")
        assert row["rules"] == report["rules"]
        for clause in report["clauses"]:
            word = (
                "pass"
                if clause["passed"]
                else "fail"
                if clause["counted"]
                else "fail (not counted)"
            )
            assert row[clause["name"]] == word


def test_the_leading_cause_agrees_with_the_instructor_for_nine_in_ten(graded):
    result, _, _ = graded
    reports = {
        Path(line["target"]).name: line for line in map(json.loads, result.stdout.splitlines())
    }
    wrong = {name: causes for name, causes in EXPECTED.items() if causes}
    agreed = [
        name
        for name, causes in wrong.items()
        if (reports[name]["root_cause"] or {}).get("mistake") in causes
    ]
    missed = {n: (reports[n]["root_cause"] or {}).get("mistake") for n in wrong if n not in agreed}
    print(f"\nleading cause agreed for {len(agreed)} of {len(wrong)}; missed: {missed}")
    assert len(agreed) >= 0.9 * len(wrong), missed
