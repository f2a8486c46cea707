"""maskln grade: the command's exit codes, report and JSON, and the child process: a hanging,
crashing, raising or memory-hungry function fails its clauses with the reason, and the grader
still finishes; a function cannot fool it. Each test starts real child processes (a few
seconds each), so they are few; tests/grading/test_grading.py grades in process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from maskln_cli.cli.report.grade import render_grade
from maskln_cli.grading import runner as grading
from maskln_cli.grading.clauses import CLAUSES
from maskln_cli.grading.runner import GradeReport, grade
from tests.clitools import ROOT, assert_one_line_error, grade_command, run_without_torch_check
from tests.solutions import broken

REQUIRED = [name for name, clause in CLAUSES.items() if clause.level == "required"]
STRICT = [name for name, clause in CLAUSES.items() if clause.level == "strict"]
RUN_BY_DEFAULT = REQUIRED + STRICT  # optional clauses (half precision) run only when named
SOLUTIONS = ROOT / "tests" / "solutions"
EXAMPLE = ROOT / "examples" / "first_attempt.py"


@pytest.mark.slow  # a whole grade in a real child: make test-slow
def test_maskln_grades_its_own_op_strict_included():
    result = grade_command("maskln_cli:masked_layer_normalization", "--strict", "--json")
    assert result.exit_code == 0, result.stdout
    document = json.loads(result.stdout)
    assert document["passed"] is True and document["strict"] is True
    assert [c["name"] for c in document["clauses"]] == RUN_BY_DEFAULT
    assert all(c["passed"] and c["detail"] is None for c in document["clauses"])


@pytest.mark.slow  # a whole grade in a real child: make test-slow
def test_a_file_that_imports_maskln_op_fails_raw_ops(tmp_path):
    """Only maskln's own target may run maskln's op: a file that re-exports it uses it."""
    path = tmp_path / "solution.py"
    path.write_text("from maskln_cli import masked_layer_normalization  # noqa: F401\n")
    result = grade_command(path, "--json")
    assert result.exit_code == 1
    failing = [c for c in json.loads(result.stdout)["clauses"] if not c["passed"]]
    assert [c["name"] for c in failing] == ["raw_ops"]
    assert (
        "a ready-made normalization ran: maskln::masked_layer_norm (forward)"
        in failing[0]["detail"]
    )


def test_the_example_first_attempt_fails_with_a_report():
    result = grade_command(EXAMPLE)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"maskln grade {EXAMPLE}")
    rows = {line.split()[1]: line.split()[0] for line in lines if line.startswith("  PASS")
            or line.startswith("  FAIL")}  # fmt: skip
    assert list(rows) == RUN_BY_DEFAULT
    assert {name for name, verdict in rows.items() if verdict == "FAIL"} == {
        "sanitized_gradients",
        "output_layout",
    }
    detail = lines[lines.index(next(x for x in lines if "FAIL  sanitized_gradients" in x)) + 1]
    assert "NaN, ±inf and 1e30 in invalid rows" in detail and "gave nan" in detail
    # The one mistake leads the report, with its fix (not repeated as a diagnosis below).
    assert lines[2] == "root cause: one mistake explains the failing clause"
    assert lines[3].startswith("  NaN or inf from the padding of x reaches grad_x")
    assert lines[4].startswith("  fix: sanitize x before the reductions")
    assert "diagnosis" not in lines
    assert lines[-1] == (
        f"FAIL: {len(REQUIRED) - 1} of {len(REQUIRED)} required clauses pass;"
        f" failed: sanitized_gradients; not counted: {len(STRICT) - 1} of {len(STRICT)} strict"
        " pass (failed: output_layout)"
    )


def test_json_document():
    result = grade_command(EXAMPLE, "--json", "--only", "sanitized_gradients", "--only", "values")
    assert result.exit_code == 1
    document = json.loads(result.stdout)
    assert set(document) == {
        "passed", "target", "op", "strict", "included", "rules", "rules_source", "seed",
        "device", "problem", "root_cause", "differs", "failed", "clauses", "diagnosis",
    }  # fmt: skip
    assert document["passed"] is False and document["target"] == str(EXAMPLE)
    assert document["op"] == "layer"
    assert document["failed"] == ["sanitized_gradients"] and document["problem"] is None
    assert document["root_cause"]["mistake"] == "nan_from_padding"
    assert document["root_cause"]["explains"] == ["sanitized_gradients"]
    values, sanitized = document["clauses"]
    assert set(values) == {
        "name", "level", "required", "counted", "passed", "seconds", "detail", "diagnosis",
        "cause",
    }  # fmt: skip
    assert values == {**values, "name": "values", "passed": True, "detail": None}
    assert values["diagnosis"] is None and values["seconds"] >= 0
    assert sanitized["passed"] is False and "gave nan" in sanitized["detail"]
    assert [d["mistake"] for d in sanitized["diagnosis"]] == ["nan_from_padding"]
    assert document["diagnosis"][0]["clause"] == "sanitized_gradients"


@pytest.mark.slow  # a real child process hung, killed or starved: make test-slow
def test_a_hanging_function_times_out_and_the_next_clause_still_runs():
    target = f"{SOLUTIONS / 'misbehaving.py'}:hangs_on_wide_rows"
    result = grade_command(target, "--timeout", "2", "--only", "dtypes", "--only", "values",
                    "--json")  # fmt: skip
    assert result.exit_code == 1
    values, dtypes = json.loads(result.stdout)["clauses"]
    assert dtypes["passed"] is False and dtypes["detail"].startswith("timed out after 2 s")
    assert dtypes["seconds"] < 2 + 2 * 1.0 + 5  # the timeout, the kill's grace, some slack
    assert values["passed"] is True  # a fresh child ran it


@pytest.mark.slow  # a real child process hung, killed or starved: make test-slow
def test_a_crashing_function_fails_its_clauses_then_the_rest_are_not_run():
    target = f"{SOLUTIONS / 'misbehaving.py'}:crashes"
    result = grade_command(target, "--only", "worked_example", "--only", "values",
                    "--only", "dtypes")  # fmt: skip
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    details = [lines[i + 1].strip() for i, line in enumerate(lines) if line.startswith("  FAIL")]
    assert details[0].startswith("the process crashed: SIGSEGV (a segmentation fault)")
    assert "Fatal Python error: Segmentation fault" in details[0]  # what it printed
    assert details[1] == "the process exited with code 3 in the middle of the clause"
    assert details[2] == (
        "not run: the function crashed or hung in 2 clauses in a row (worked_example, values)"
    )
    assert lines[-1] == "FAIL: 0 of 3 required clauses pass; failed: worked_example, values, dtypes"


def test_a_raising_function_fails_every_clause_in_one_child():
    result = grade_command(f"{SOLUTIONS / 'misbehaving.py'}:starter_code", "--json")
    assert result.exit_code == 1
    clauses = json.loads(result.stdout)["clauses"]
    assert [c["name"] for c in clauses] == RUN_BY_DEFAULT
    for c in clauses:
        assert c["passed"] is False
        assert "NotImplementedError: Implement masked_layer_normalization" in c["detail"], c


@pytest.mark.slow  # a real child process hung, killed or starved: make test-slow
def test_an_allocation_beyond_the_memory_cap_fails_the_clause(monkeypatch):
    monkeypatch.setenv("MASKLN_GRADE_MEMORY_GIB", "1.5")
    target = f"{SOLUTIONS / 'misbehaving.py'}:allocates_too_much"
    result = grade_command(target, "--only", "worked_example", "--json")
    assert result.exit_code == 1
    (worked,) = json.loads(result.stdout)["clauses"]
    assert (
        worked["detail"]
        .split(": ", 1)[1]
        .startswith("out of memory (cap 1.5 GiB, MASKLN_GRADE_MEMORY_GIB)")
    )


@pytest.mark.slow  # a real child process hung, killed or starved: make test-slow
def test_patching_torch_in_the_child_cannot_change_a_verdict():
    target = f"{SOLUTIONS / 'misbehaving.py'}:fools_comparisons"
    result = grade_command(target, "--only", "values", "--only", "worked_example", "--json")
    assert result.exit_code == 1
    document = json.loads(result.stdout)
    assert [c["passed"] for c in document["clauses"]] == [False, False]
    assert document["diagnosis"][0]["mistake"] == "bias_missing"


@pytest.mark.slow  # a real child process hung, killed or starved: make test-slow
@pytest.mark.parametrize(
    ("source", "fragments"),
    [
        ("import no_such_module_here\n", ["cannot import", "No module named"]),
        ("import os\nos._exit(5)\n", ["cannot import", "exited with code 5"]),
    ],
)
def test_a_target_that_cannot_be_loaded_is_a_one_line_usage_error(tmp_path, source, fragments):
    path = tmp_path / "solution.py"
    path.write_text(source)
    result = grade_command(path)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, str(path), *fragments)


@pytest.mark.slow  # a real child process hung, killed or starved: make test-slow
def test_a_target_whose_import_hangs_is_stopped_after_the_timeout(tmp_path):
    path = tmp_path / "solution.py"
    path.write_text("import time\n\ntime.sleep(3600)\n")
    started = time.monotonic()
    result = grade_command(path, "--timeout", "2")
    elapsed = time.monotonic() - started
    assert result.exit_code == 2
    assert_one_line_error(
        result.stderr, str(path), "cannot import: it did not finish within 2 s (--timeout)"
    )
    assert elapsed < 30  # torch's import in the child, 2 s, the kill's grace; not 60 s


def test_a_missing_target_or_a_bad_option_is_a_one_line_usage_error():
    result = grade_command("no/such/solution.py")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "TARGET no/such/solution.py: no such file")
    result = grade_command(EXAMPLE, "--only", "nope")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "--only: no clause 'nope'")
    result = grade_command(EXAMPLE, "--timeout", "0")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "--timeout: must be a positive number of seconds")
    result = grade_command(EXAMPLE, "--device", "nosuch")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "--device: not a device: 'nosuch'")
    if not torch.xpu.is_available():
        result = grade_command(EXAMPLE, "--device", "xpu")
        assert result.exit_code == 2
        assert_one_line_error(result.stderr, "--device xpu: no xpu device is available")


def test_grade_help_does_not_import_torch():
    result = run_without_torch_check("grade", "--help")
    assert not result.torch_imported, result.stderr


# --- rendering ------------------------------------------------------------------------------------


def test_the_report_escapes_what_the_function_said(capsys):
    hostile = "\x1b[2J[bold red]owned[/]"
    result = GradeReport("f", False, [grading.ClauseResult("values", True, False, 0.1, hostile)])
    render_grade(result)
    out = capsys.readouterr().out
    assert "\x1b[2J" not in out and "\\x1b[2J[bold red]owned[/]" in out


def test_quiet_prints_the_verdict_line_only(capsys):
    result = grade(broken.contiguous_output, only=["values", "output_layout"])
    render_grade(result, quiet=True)
    assert capsys.readouterr().out == (
        "FAIL: 1 of 2 counted clauses (1 required, 1 strict) pass; failed: output_layout\n"
    )


def test_the_command_defaults_are_the_librarys():
    """cli.py spells the defaults out (importing grading would import torch for --help)."""
    import typer.main

    from maskln_cli.cli import grade as command
    from maskln_cli.cli.app import app

    params = {p.name: p.default for p in typer.main.get_command(app).commands["grade"].params}
    # --seed and --timeout default to the rules' (issue 32), else to these
    assert params["seed"] is None and command.DEFAULT_SEED == grading.DEFAULT_SEED
    assert params["timeout"] is None and command.DEFAULT_TIMEOUT == grading.DEFAULT_TIMEOUT
    assert params["device"] == "cpu" and params["strict"] is False


# --- a function that goes after the grader -----------------------------------------------------

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc: Linux")


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except OSError:
        return False


def ended_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    ended = not alive(pid)
    if not ended:
        os.kill(pid, signal.SIGKILL)  # leave nothing behind
    return ended


CORRECT = "from tests.solutions.correct import masked_layer_normalization as correct\n"

DETACHES = (
    CORRECT
    + """
import os, time

def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    if os.fork() == 0:  # a daemon: out of the child's session, then orphaned
        os.setsid()
        if os.fork() == 0:
            with open({pidfile!r}, "w") as out:
                out.write(str(os.getpid()))
            time.sleep(60)
        os._exit(0)
    os.wait()
    return correct(x, valid, scale, bias, eps)
"""
)

LEAVES_THE_GROUP = (
    CORRECT
    + """
import os, time

def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    if os.fork() == 0:  # out of the child's process group, still in its session
        os.setpgid(0, 0)
        with open({pidfile!r}, "w") as out:
            out.write(str(os.getpid()))
        time.sleep(60)
        os._exit(0)
    return correct(x, valid, scale, bias, eps)
"""
)

KILLS_THE_GRADER = """
import os, signal, time

def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    with open({pidfile!r}, "w") as out:
        out.write(str(os.getpid()))
    try:
        os.kill(os.getppid(), signal.SIGKILL)
    except PermissionError:  # the child may signal no process but its own
        time.sleep(3)  # the test kills the grader meanwhile
    time.sleep(60)
"""


def solution(tmp_path, source: str):
    pidfile = tmp_path / "pid"
    path = tmp_path / "solution.py"
    path.write_text(source.format(pidfile=str(pidfile)))
    return path, pidfile


@pytest.mark.slow  # a real child process hung, killed or starved: make test-slow
@LINUX
def test_a_process_the_function_detaches_is_killed_with_the_child(tmp_path):
    """A double fork and setsid leave the child's process group and session; the command is a
    child subreaper while it grades, so the daemon comes back to it and is killed."""
    path, pidfile = solution(tmp_path, DETACHES)
    result = grade_command(path, "--only", "worked_example")
    assert result.exit_code == 0, result.stdout
    assert ended_within(int(pidfile.read_text()), 0.5)


@LINUX
def test_a_process_that_leaves_the_childs_group_is_killed_with_its_session(tmp_path, monkeypatch):
    """grade_target without contain_processes (a library caller's process): the session."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the solution imports tests.solutions
    path, pidfile = solution(tmp_path, LEAVES_THE_GROUP)
    assert grading.grade_target(str(path), only=["worked_example"]).passed
    assert ended_within(int(pidfile.read_text()), 0.5)


@pytest.mark.slow  # a real child process hung, killed or starved: make test-slow
@LINUX
def test_the_child_cannot_kill_the_grader_nor_outlive_it(tmp_path):
    """The child may send no signal outside its own processes (:mod:`~.grading.confine`); when
    the grader dies anyway (killed from elsewhere: no verdict then, exit -9, never 0), the child
    gets SIGKILL too (PR_SET_PDEATHSIG) instead of running on."""
    path, pidfile = solution(tmp_path, KILLS_THE_GRADER)
    command = [sys.executable, "-m", "maskln_cli", "grade", str(path), "--only", "worked_example"]
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL) as grader:
        while not pidfile.exists() or not pidfile.read_text():
            time.sleep(0.05)
        time.sleep(1)
        assert grader.poll() is None  # the child's SIGKILL was refused
        grader.kill()
    assert grader.returncode == -signal.SIGKILL
    assert ended_within(int(pidfile.read_text()), 5)


NOT_DUMPABLE_PROBE = """
import os, subprocess, sys
sys.path.insert(0, sys.argv[1])
from maskln_cli.grading import sandbox
ATTEMPT = (
    "import os\\n"
    "try:\\n"
    "    with open(f'/proc/{os.getppid()}/fd/1', 'a') as out:\\n"
    "        out.write('')\\n"
    "    print('opened')\\n"
    "except OSError as error:\\n"
    "    print(type(error).__name__)\\n"
)
read, write = os.pipe()  # this process's stdout: a pipe of its user's, as its terminal is
os.dup2(write, 1)
def attempt():
    child = [sys.executable, "-c", ATTEMPT]
    return subprocess.run(child, capture_output=True, text=True).stdout.strip()
results = [attempt()]
with sandbox.protected_grader():
    results.append(attempt())
results.append(attempt())
print(" ".join(results), file=sys.stderr)
"""


def unprivileged_python() -> tuple[str, dict]:
    """An interpreter, and subprocess options, to run it as a user that is not root."""
    if os.geteuid() != 0:
        return sys.executable, {}
    nobody = {"user": 65534, "group": 65534, "extra_groups": []}
    # The probe imports maskln_cli from this checkout: one in a folder only root may read (a
    # clone under `mktemp -d`) cannot be run that way.
    can_import = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import maskln_cli.grading.sandbox"
    for python in (sys.executable, "/usr/bin/python3"):
        try:
            subprocess.run([python, "-c", can_import], check=True, cwd="/", **nobody)
        except (OSError, subprocess.CalledProcessError):
            continue
        return python, nobody
    pytest.skip("root, and no Python interpreter with which user 65534 can import this checkout")


@LINUX
def test_a_same_user_process_cannot_open_the_graders_stdout_while_it_grades():
    """Root can anyway (the threat model, docs/grading/sandbox.md); as another user this runs
    unprivileged."""
    python, options = unprivileged_python()
    probe = subprocess.run(
        [python, "-c", NOT_DUMPABLE_PROBE, str(ROOT)],
        capture_output=True, text=True, cwd="/", timeout=60, **options,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    assert probe.stderr.split() == ["opened", "PermissionError", "opened"]
