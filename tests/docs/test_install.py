"""The install step of the Makefile (what `make demo` and `make test` do first on a fresh clone):
torch and what the native build needs come first, then the native kernels compile while pip
installs the rest; a failed build is a warning (the raw-op kernels are used), a failed pip is a
failure, and the stamp is written only when the install succeeded. The recipe runs as is, with a
stand-in for the venv's python that logs what it is asked to do."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.docs.runner import ROOT

# The stand-in: `python -m pip install ...` and `python -m maskln_cli.op.native`, each logged; the
# second pip and the native build each wait (up to 30 s) for the other to have started, so both
# finish only when they run side by side. FAIL_<what> makes one of them fail.
STAND_IN = r"""#!/bin/sh
log="$LOG_DIR/events"
wait_for() { i=0; while [ ! -e "$LOG_DIR/$1" ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; }
if [ "$2" = pip ]; then
    case "$*" in
    *--editable*)
        echo "pip rest start" >> "$log"; touch "$LOG_DIR/rest-started"; wait_for native-started
        echo "pip rest end" >> "$log"; [ -z "$FAIL_REST" ] || exit 1 ;;
    *)
        echo "pip first: $(echo "$@" | sed 's/.*constraints.txt //')" >> "$log"
        [ -z "$FAIL_FIRST" ] || exit 1 ;;
    esac
elif [ "$2" = maskln_cli.op.native ]; then
    echo "native start" >> "$log"; touch "$LOG_DIR/native-started"; wait_for rest-started
    echo "native end" >> "$log"; echo "the build's own words"
    [ -z "$FAIL_NATIVE" ] || exit 1
fi
"""
WARNING = "maskln: native kernels not built; the op uses the raw-op kernels"


def install(tmp_path: Path, **fail: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    for name in ("pyproject.toml", "constraints.txt"):
        (tmp_path / name).touch()
    stamp = venv / ".installed"
    env = {
        **os.environ,
        "LOG_DIR": str(tmp_path),
        **{f"FAIL_{k.upper()}": v for k, v in fail.items()},
    }
    done = subprocess.run(
        ["make", "--no-print-directory", "-f", str(ROOT / "Makefile"), str(stamp),
         f"VENV={venv}", f"INSTALLED={stamp}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    events = (
        (tmp_path / "events").read_text().splitlines() if (tmp_path / "events").exists() else []
    )
    return done, events


def test_torch_comes_first_then_the_native_build_runs_beside_the_rest_of_pip(tmp_path):
    done, events = install(tmp_path)
    assert done.returncode == 0, done.stderr
    assert events[0] == "pip first: torch ninja numpy"
    # Each of the two waited for the other to start: both ran at once.
    assert sorted(events[1:]) == ["native end", "native start", "pip rest end", "pip rest start"]
    assert "the build's own words" in done.stdout
    assert WARNING not in done.stdout.splitlines()
    assert (tmp_path / "venv" / ".installed").exists()


def test_a_failed_native_build_is_a_warning_and_the_install_still_succeeds(tmp_path):
    done, _ = install(tmp_path, native="1")
    assert done.returncode == 0, done.stderr
    assert "the build's own words" in done.stdout
    assert WARNING in done.stdout.splitlines()
    assert (tmp_path / "venv" / ".installed").exists()


@pytest.mark.parametrize(
    ("fail", "ran"),
    [("first", ["pip first: torch ninja numpy"]), ("rest", None)],
    ids=["torch's pip", "the rest's pip"],
)
def test_a_failed_pip_fails_the_install_and_writes_no_stamp(tmp_path, fail, ran):
    done, events = install(tmp_path, **{fail: "1"})
    assert done.returncode != 0
    assert not (tmp_path / "venv" / ".installed").exists()
    if ran is not None:  # nothing is built on a torch that did not install
        assert events == ran
    else:  # the build was waited for, not left running
        assert "native end" in events
