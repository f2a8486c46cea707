"""`make demo` warns before the grade that its FAIL is deliberate, and ends with a line saying the
demo completed, only when the grade failed as intended. The Makefile's recipe runs as is, with a
stand-in for maskln (a real demo takes a minute: torch, normalize, verify and a whole grade)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.docs.runner import ROOT

WARNING = "deliberate mistake"
EXPECTED = "FAIL is the expected"
COMPLETED = "The demo completed"
GRADE_SAYS = "FAIL: 13 of 14 required clauses pass"


def run_demo(tmp_path: Path, grade_exit: int) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "maskln"
    stand_in.write_text(
        '#!/bin/sh\nif [ "$1" = grade ]; then echo "'
        + GRADE_SAYS
        + '"; exit '
        + str(grade_exit)
        + '; fi\necho "maskln $1"\n'
    )
    stand_in.chmod(0o755)
    # The install step is up to date: its stamp is newer than what it depends on.
    for name, when in (("pyproject.toml", 1), ("constraints.txt", 1), ("installed", 2)):
        (tmp_path / name).touch()
        os.utime(tmp_path / name, (when, when))
    overrides = [f"BIN={bin_dir}", f"INSTALLED={tmp_path / 'installed'}"]
    return subprocess.run(
        ["make", "--no-print-directory", "-f", str(ROOT / "Makefile"), "demo", *overrides],
        cwd=tmp_path,
        env={**os.environ, "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_demo_says_the_fail_is_expected_before_the_grade_and_ends_completed(tmp_path):
    done = run_demo(tmp_path, grade_exit=1)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.index(WARNING) < out.index(GRADE_SAYS)
    assert out.index(EXPECTED) < out.index(GRADE_SAYS)
    assert out.rstrip().splitlines()[-1].startswith(COMPLETED)


@pytest.mark.parametrize("grade_exit", [0, 2], ids=["the grade passed", "the grader could not run"])
def test_the_demo_fails_and_says_nothing_completed_when_the_grade_does_not_fail(
    tmp_path, grade_exit
):
    done = run_demo(tmp_path, grade_exit)
    assert done.returncode != 0
    assert COMPLETED not in done.stdout
    assert f"the grade exited {grade_exit}, not 1" in done.stderr
