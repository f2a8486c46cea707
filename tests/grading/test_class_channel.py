"""The parts of a class grade's defences that need no torch in a child (issue 31, section 1):
an answer is taken only with its job's nonce, the child's confinement refuses what would reach
another process, and `--jobs` below 1 is a usage error. The attacks themselves, on real classes,
are tests/grading/test_class_attacks.py (slow)."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time

import pytest

from maskln_cli.grading import classroom
from maskln_cli.grading.classroom import ATTEMPTS, ClassReport, _Classroom, _Job
from tests.clitools import ROOT, assert_one_line_error, invoke

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl, seccomp: Linux")


@pytest.mark.parametrize("jobs", ["0", "-3"])
def test_jobs_below_one_is_a_usage_error_naming_the_option(jobs, tmp_path):
    (tmp_path / "a.py").write_text("")
    result = invoke("grade", tmp_path, "--jobs", jobs)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, f"--jobs: must be at least 1, got {jobs}")


class FakeWorker(classroom._Worker):
    """A worker whose process is this test's: its channel is a socket pair's end."""

    def __init__(self) -> None:
        self.channel, self.other = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.job = None
        self.ready = {"ready": True}
        self.buffer = b""


def a_classroom(*targets: str) -> _Classroom:
    request = {"strict": False, "seed": 0}
    return _Classroom(ClassReport(list(targets)), request, 60.0, 1, None)


REPORT = {"target": "b.py", "strict": False, "seed": 0, "clauses": [
    {"name": "values", "required": True, "passed": True, "seconds": 0.1}]}  # fmt: skip


@pytest.mark.parametrize("nonce", ["forged", None, 7])
def test_an_answer_without_its_jobs_nonce_is_a_lost_worker_never_a_verdict(nonce):
    """Whoever wrote it (a worker's channel cannot be opened by another process): the target is
    graded again on a fresh worker; after the last attempt its row is a grader error."""
    room = a_classroom("b.py")
    room.pending.clear()
    worker = FakeWorker()
    room.workers.append(worker)
    worker.send(_Job(0, "b.py"), {}, 60.0)
    assert worker.job is not None and len(worker.job.nonce) == 32
    worker.other.sendall(b'{"job": %s, "report": %s}\n' % (
        json_value(nonce), json_value(REPORT)))  # fmt: skip
    room.collect(worker, readable=True)
    assert room.workers == [] and worker.process.poll() is not None  # stopped
    assert room.done == {} and [j.target for j in room.pending] == ["b.py"]  # graded again
    job = room.pending.popleft()
    assert job.attempts == 1
    job.attempts = ATTEMPTS - 1
    again = FakeWorker()
    room.workers.append(again)
    again.send(job, {}, 60.0)
    again.other.close()  # this worker ends: the last attempt
    room.collect(again, readable=True)
    report = room.done[0]
    assert not report.passed and report.problem.startswith("grader error: its worker process ended")


def test_the_answer_with_its_nonce_is_the_targets_report():
    room = a_classroom("b.py")
    worker = FakeWorker()
    room.workers.append(worker)
    worker.send(_Job(0, "b.py"), {}, 60.0)
    nonce = worker.job.nonce
    worker.other.sendall(b'{"job": "%s", "report": %s}\n' % (nonce.encode(), json_value(REPORT)))
    room.collect(worker, readable=True)
    assert room.done[0].passed and worker.job is None and room.workers == [worker]
    worker.stop()


def json_value(value: object) -> bytes:
    import json

    return json.dumps(value).encode()


CONFINED = """
import ctypes, fcntl, os, platform, resource, signal, socket, sys
from maskln_cli.grading.confine import confine
victim = int(sys.argv[1])
missing = confine()
libc = ctypes.CDLL(None, use_errno=True)
X86 = platform.machine() == "x86_64"

def raw(result):
    if result == -1:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    if result == 0:
        os._exit(0)  # a clone that went through: its child ends at once

def clone_parent():  # a sibling whose exit signal, SIGKILL, would go to our parent
    if X86:
        raw(libc.syscall(56, 0x8000 | signal.SIGKILL, 0, 0, 0, 0))

def owner():  # SIGIO, or any F_SETSIG signal, for the victim
    fcntl.fcntl(socket.socket().fileno(), fcntl.F_SETOWN, victim)

tried = []
for what, attempt in [
    ("kill", lambda: os.kill(victim, signal.SIGKILL)),
    ("kill -1", lambda: os.kill(-1, signal.SIGKILL)),
    ("killpg", lambda: os.killpg(victim, signal.SIGKILL)),
    ("tgkill", lambda: raw(libc.syscall(234, victim, victim, 9)) if X86 else None),
    ("ptrace", lambda: raw(libc.ptrace(16, victim, 0, 0))),
    ("fd", lambda: open(f"/proc/{victim}/fd/1", "wb")),
    ("mem", lambda: open(f"/proc/{victim}/mem", "rb")),
    ("clone_parent", clone_parent),
    ("f_setown", owner),
    ("prlimit", lambda: resource.prlimit(victim, resource.RLIMIT_CPU, (1, 1))),
    ("setpriority", lambda: os.setpriority(os.PRIO_PROCESS, victim, 19)),
    ("setpriority user", lambda: os.setpriority(os.PRIO_USER, os.getuid(), 19)),
    ("affinity", lambda: os.sched_setaffinity(victim, {0})),
    ("own limits", lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0))),
    ("own group", lambda: os.killpg(os.getpid(), signal.SIGCONT)),
    ("probe", lambda: os.kill(victim, 0)),
]:
    try:
        attempt()
        tried.append(f"{what}: done")
    except OSError as error:
        tried.append(f"{what}: {type(error).__name__}")
print(missing, "; ".join(tried))
"""

NOT_DUMPABLE = "import ctypes, time; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); time.sleep(60)"


@LINUX
def test_a_confined_child_reaches_no_process_but_its_own():
    """What a submission would use to reach a worker (not dumpable, same user): each refused
    (an RLIMIT_CPU of one second set on it would kill it); its own limits it may set, its own
    process group signal, and any process probe. Run as root, too: the child has no capability
    left."""
    with subprocess.Popen([sys.executable, "-c", NOT_DUMPABLE]) as victim:
        try:
            time.sleep(0.5)  # not dumpable by now
            result = subprocess.run(
                [sys.executable, "-c", CONFINED, str(victim.pid)],
                capture_output=True, text=True, timeout=60, start_new_session=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
            assert victim.poll() is None  # alive
        finally:
            victim.kill()
    assert result.returncode == 0, result.stderr
    missing, _, tried = result.stdout.strip().partition(" ")
    assert missing == "[]"
    refused = ["kill", "kill -1", "killpg", "tgkill", "ptrace", "fd", "mem", "clone_parent",
               "f_setown", "prlimit", "setpriority", "setpriority user", "affinity"]  # fmt: skip
    allowed = ["own limits", "own group", "probe"]
    expected = [f"{what}: PermissionError" for what in refused] + [f"{a}: done" for a in allowed]
    if platform.machine() != "x86_64":
        expected[3] = "tgkill: done"  # not tried
        expected[7] = "clone_parent: done"
    assert tried.split("; ") == expected


def test_bytecode_written_again_is_no_change_but_other_code_is(tmp_path):
    """Python (in another process) writing a module's missing or stale bytecode again is not
    tampering; a .pyc holding other code than its source's (one Python could run instead) is."""
    import py_compile

    from maskln_cli.grading import guard

    source = tmp_path / "graded_helper.py"
    source.write_text("VALUE = 1\n")
    cached = py_compile.compile(str(source), doraise=True)
    snapshot = guard.Snapshot([str(source), cached])
    time.sleep(0.01)
    os.unlink(cached)
    py_compile.compile(str(source), doraise=True)  # a new file, the same code
    assert snapshot.changed() == []
    planted = tmp_path / "planted.py"
    planted.write_text("VALUE = 2  # the grader's verdicts, forged\n")
    py_compile.compile(str(planted), cfile=cached, doraise=True)
    assert snapshot.changed() == [cached]
    assert not guard.same_bytecode(cached) and not guard.same_bytecode(str(source))
