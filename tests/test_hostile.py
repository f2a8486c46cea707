"""Hostile inputs and interrupted writes: nothing crashes, nothing is lost.

The format fuzzing lives in test_fuzz.py; here are the hand-made cases: semantic bad input,
resource limits, signals and concurrent writers, and the security promises.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import maskln_cli
from maskln_cli.files import output as outputs
from maskln_cli.files import resources, tensorfile
from tests.clitools import (
    PAIRS,
    ROOT,
    WORKED,
    assert_one_line_error,
    invoke,
    leftovers,
    read,
    run,
    write,
    writing_into,
)

# In `make test-slow` (CI), not `make test`: real processes, signals and full disks.
pytestmark = pytest.mark.slow


def small_inputs(**overrides):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "x": torch.randn(3, 4, 8, generator=generator),
        "valid": torch.rand(3, 4, generator=generator) > 0.3,
        "scale": torch.randn(8, generator=generator),
        "bias": torch.randn(8, generator=generator),
    }
    tensors.update(overrides)
    return tensors


def raw_safetensors(header: dict, data: bytes = b"") -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


# --- semantic bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"x": torch.ones(3, 4, 8, dtype=torch.bool)}, ("'x'", "bool")),
        ({"x": torch.ones(3, 4, 8, dtype=torch.int32)}, ("'x'", "int32")),
        ({"x": torch.ones(3, 4, 8, dtype=torch.complex64)}, ("'x'", "complex64")),
        ({"x": torch.tensor(2.0)}, ("'x'", "0-d")),
        (
            {"x": torch.ones(3, 4, 0), "scale": torch.ones(0), "bias": torch.ones(0)},
            ("zero channels",),
        ),
        ({"valid": torch.ones(4, 3, dtype=torch.bool)}, ("'valid'", "[4, 3]", "[3, 4]")),
        ({"valid": torch.full((3, 4), 2, dtype=torch.int8)}, ("'valid'", "0 and 1")),
        ({"valid": torch.ones(3, 4, dtype=torch.complex64)}, ("'valid'", "complex64")),
        ({"scale": torch.ones(2, 8)}, ("'scale'", "[2, 8]")),
        ({"bias": torch.ones(())}, ("'bias'", "[]")),
        ({"bias": torch.ones(8, dtype=torch.bool)}, ("'bias'", "bool")),
    ],
)
def test_semantic_bad_input(tmp_path, overrides, fragments):
    source = write(tmp_path / "in.safetensors", small_inputs(**overrides))
    result = invoke("normalize", source, tmp_path / "out.safetensors")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "in.safetensors", *fragments)
    assert not (tmp_path / "out.safetensors").exists()


def test_params_that_do_not_match_x_channels(tmp_path):
    source = write(tmp_path / "in.safetensors", {"x": torch.randn(3, 8)})
    checkpoint = write(
        tmp_path / "ckpt.safetensors", {"ln.weight": torch.ones(16), "ln.bias": torch.zeros(16)}
    )
    args = ["--params", checkpoint, "--scale-key", "ln.weight", "--bias-key", "ln.bias"]
    result = invoke("normalize", source, tmp_path / "o.safetensors", *args)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "ckpt.safetensors", "'ln.weight'", "[16]", "[8]")


def test_missing_eps_metadata_means_the_default(tmp_path):
    source = write(tmp_path / "in.safetensors", small_inputs())
    assert invoke("normalize", source, tmp_path / "o.safetensors").exit_code == 0
    with torch.no_grad():
        from safetensors import safe_open

        with safe_open(str(tmp_path / "o.safetensors"), "pt") as handle:
            assert handle.metadata()["eps"] == "1e-05"


@pytest.mark.parametrize("eps", ["-1", "0", "nan", "inf", "-inf", "1e400", "", "abc", "1e-5 "])
def test_bad_eps_in_metadata(tmp_path, eps):
    source = write(tmp_path / "in.safetensors", small_inputs(), eps=eps)
    result = invoke("normalize", source, tmp_path / "o.safetensors")
    if eps == "1e-5 ":  # float() accepts surrounding spaces: a usable eps
        assert result.exit_code == 0
        return
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "in.safetensors", "metadata 'eps'")


# --- resource limits ----------------------------------------------------------------------------


def test_header_declaring_more_data_than_the_file_holds_is_rejected_at_once(tmp_path):
    huge = tmp_path / "huge.safetensors"
    header = {"x": {"dtype": "F32", "shape": [2**40, 8], "data_offsets": [0, 2**45]}}
    huge.write_bytes(raw_safetensors(header, b"\x00" * 64))
    started = time.monotonic()
    for command in (["normalize", huge, tmp_path / "o.safetensors"], ["inspect", huge]):
        result = invoke(*command)
        assert result.exit_code == 2
        assert_one_line_error(result.stderr, "huge.safetensors", "not a valid safetensors file")
    assert time.monotonic() - started < 10  # nothing was allocated or read


def test_stdin_is_bounded(tmp_path):
    limit = {"MASKLN_STDIN_MAX_BYTES": "1000"}
    result = run("inspect", "-", input=PAIRS.read_bytes(), environment=limit)
    assert result.returncode == 2
    assert_one_line_error(
        result.stderr, "<stdin>", "more than 1000 bytes", "MASKLN_STDIN_MAX_BYTES"
    )
    fits = run("inspect", "-", input=WORKED.read_bytes(), environment=limit)
    assert fits.returncode == 0


def test_bad_stdin_limit_setting(monkeypatch):
    monkeypatch.setenv("MASKLN_STDIN_MAX_BYTES", "lots")
    result = invoke("inspect", "-", input=WORKED.read_bytes())
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "MASKLN_STDIN_MAX_BYTES", "'lots'")


def test_generate_refuses_what_memory_cannot_hold(tmp_path):
    result = invoke("generate", tmp_path / "g.safetensors", "--shape", "1000000,1000000,64")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "--shape 1000000,1000000,64", "of memory", "available")
    assert list(tmp_path.iterdir()) == []


def test_chunks_that_memory_cannot_hold_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(resources, "available_memory", lambda: 10_000)
    source = write(
        tmp_path / "in.safetensors",
        small_inputs(x=torch.randn(400, 8), valid=torch.ones(400, dtype=torch.bool)),
    )
    result = invoke("normalize", source, tmp_path / "o.safetensors", "--chunk-rows", "400")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "--chunk-rows 400", "of memory")
    assert (
        invoke("normalize", source, tmp_path / "o.safetensors", "--chunk-rows", "20").exit_code == 0
    )


def test_output_that_the_disk_cannot_hold_is_refused_before_writing(tmp_path, monkeypatch):
    class Usage:
        free = 100
        total = 10**12

    monkeypatch.setattr(resources.shutil, "disk_usage", lambda path: Usage)
    output = tmp_path / "out.safetensors"
    output.write_bytes(b"keep me")
    result = invoke("normalize", PAIRS, output)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "out.safetensors", "on disk", "100 B")
    assert output.read_bytes() == b"keep me" and leftovers(tmp_path) == []


# --- interrupted and concurrent writes ----------------------------------------------------------


@pytest.fixture(scope="module")
def large_input(tmp_path_factory) -> Path:
    """A 64 MiB input: large enough that writing its output takes a while in small chunks."""
    path = tmp_path_factory.mktemp("large") / "large.safetensors"
    assert run("generate", path, "--shape", "131072,128", "--quiet").returncode == 0
    return path


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_during_a_large_write_leaves_output_untouched(tmp_path, large_input, signum, code):
    output = tmp_path / "out.safetensors"
    output.write_bytes(b"the previous result")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "maskln_cli",
            "normalize",
            large_input,
            output,
            "--chunk-rows",
            "2",  # 65,536 small writes: still writing when the signal lands, on any machine
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        # pytest-xdist's workers ignore SIGINT, and an ignored SIGINT is inherited (and rightly
        # respected by Python): the child gets the default disposition, as from a shell.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while not writing_into(process.pid, tmp_path):  # the write has begun
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == code, stderr
    assert_one_line_error(stderr, "the output being written was discarded")
    assert output.read_bytes() == b"the previous result"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_while_stdout_is_a_pipe_nobody_reads_ends_promptly(large_input, signum, code):
    """OUTPUT '-' into a pipe whose reader has stalled: the write blocks, and a signal must still
    end the command at once (it did not while a writer thread held the pipe)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "maskln_cli", "normalize", large_input, "-"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    first = process.stdout.read(1)  # the header is out: the pipe fills up behind it
    assert first, process.stderr.read()
    time.sleep(1.0)
    process.send_signal(signum)
    try:
        process.wait(timeout=20)  # without reading stdout: the reader stays stalled
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == code, process.stderr.read()


def test_interrupt_as_the_temporary_file_is_created_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C landing just after the temporary file exists (the C call has returned, its result
    not yet assigned) still removes it: its name is known before it is created."""

    real_open = os.open

    def open_then_interrupt(name, flags, mode=0o777):
        os.close(real_open(name, flags, mode))
        raise KeyboardInterrupt

    monkeypatch.setattr(tensorfile.os, "open", open_then_interrupt)
    output = tmp_path / "out.safetensors"
    with pytest.raises(KeyboardInterrupt):
        outputs.write_tensors(str(output), {"x": torch.ones(3)})
    assert leftovers(tmp_path) == [] and not output.exists()


def test_two_writers_of_one_output_leave_one_whole_file(tmp_path):
    output = tmp_path / "out.safetensors"
    commands = [
        [
            sys.executable,
            "-m",
            "maskln_cli",
            "normalize",
            PAIRS,
            output,
            "--eps",
            eps,
            "--chunk-rows",
            "64",
        ]
        for eps in ("1e-05", "0.5")
    ]
    processes = [subprocess.Popen(c, stderr=subprocess.PIPE, cwd=ROOT) for c in commands]
    for process in processes:
        process.communicate(timeout=120)
        assert process.returncode == 0
    produced = read(output)  # a whole, valid file from one writer or the other
    expected = {}
    for eps in ("1e-05", "0.5"):
        single = tmp_path / f"single-{eps}.safetensors"
        assert invoke("normalize", PAIRS, single, "--eps", eps, "--chunk-rows", "64").exit_code == 0
        expected[eps] = read(single)
    assert any(all(torch.equal(produced[k], want[k]) for k in want) for want in expected.values())
    assert leftovers(tmp_path) == []


# --- security -----------------------------------------------------------------------------------

PACKAGE = Path(maskln_cli.__file__).parent


def package_source() -> str:
    return "\n".join(path.read_text() for path in sorted(PACKAGE.rglob("*.py")))


def test_nothing_is_ever_unpickled_or_run_through_a_shell():
    source = package_source()
    for forbidden in (
        "torch.load",
        "import pickle",
        "pickle.load",
        "shell=True",
        "os.system",
        "eval(",
        "exec(",
    ):
        assert forbidden not in source, forbidden
    # Only maskln grade starts processes (its sandbox's child, a class's workers; processes.py
    # only kills them), and the native kernels' build (a child compiles, loads and checks the
    # library before any process loads it): Python itself, from an argument list.
    starters = [
        path.relative_to(PACKAGE).as_posix()
        for path in sorted(PACKAGE.rglob("*.py"))
        if re.search(r"^\s*import subprocess|^\s*from subprocess", path.read_text(), re.MULTILINE)
    ]
    assert starters == [
        "grading/classroom.py",
        "grading/processes.py",
        "grading/sandbox.py",
        "op/native/__init__.py",
    ]
    assert "Popen(" not in (PACKAGE / "grading" / "processes.py").read_text().replace(
        "subprocess.Popen[", ""
    )
    for name in ("child", "worker"):
        source = PACKAGE / "grading" / ("sandbox.py" if name == "child" else "classroom.py")
        text = source.read_text()
        assert text.count("subprocess.Popen(") == 1
        popen = rf'Popen\(\s*start_command\(\s*"maskln_cli\.grading\.{name}"'
        assert re.search(popen, text), name
    from maskln_cli.grading.child import BOOTSTRAP, start_command

    command = start_command("maskln_cli.grading.worker", "3")
    assert command[:2] == [sys.executable, "-I"] and command[-4:-2] == [BOOTSTRAP, str(ROOT)]


def test_paths_are_used_as_given(tmp_path):
    """Shell metacharacters in a path are just characters."""
    strange = tmp_path / "$(touch pwned); `id` & name.safetensors"
    strange.write_bytes(WORKED.read_bytes())
    output = tmp_path / "out; rm -rf x.safetensors"
    result = run("normalize", strange, output)
    assert result.returncode == 0, result.stderr
    assert output.exists() and not (tmp_path / "pwned").exists() and not Path("pwned").exists()


HOSTILE = "\x1b[2J\x1b]0;title\x07evil\u202e[red]"


def test_hostile_keys_are_escaped_in_reports(tmp_path):
    actual = write(tmp_path / "a.safetensors", {HOSTILE: torch.ones(2)}, **{HOSTILE: HOSTILE})
    expected = write(tmp_path / "e.safetensors", {HOSTILE: torch.zeros(2)})
    outputs = [
        invoke("diff", actual, expected).stdout,
        invoke("diff", actual, expected, "--quiet").stdout,
        invoke("inspect", actual).stdout,
    ]
    for text in outputs:
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
        assert "\\x1b" in text
    # In JSON the keys are data, escaped by the JSON encoder.
    document = json.loads(invoke("diff", actual, expected, "--json").stdout)
    assert document["tensors"][0]["name"] == HOSTILE


def test_hostile_names_are_escaped_in_error_messages(tmp_path):
    """The hostile name reaches the message (the key the user asked for), escaped."""
    source = write(tmp_path / "in.safetensors", {"x": torch.ones(2, 3), HOSTILE: torch.ones(2)})
    asked = HOSTILE + "?"  # missing: the message names it, and the keys the file holds
    result = invoke("normalize", source, tmp_path / "o.safetensors", "--valid-key", asked)
    assert result.exit_code == 2
    for raw in ("\x1b", "\x07", "\u202e"):
        assert raw not in result.stderr
    assert_one_line_error(result.stderr, "\\x1b[2J", "evil", "[red]?'", "it holds")


def test_nan_and_inf_tensor_values_do_not_break_json(tmp_path):
    source = write(tmp_path / "in.safetensors", {"x": torch.tensor([math.nan, math.inf, 1.0])})
    document = json.loads(invoke("inspect", "--json", source).stdout)
    assert document["tensors"][0]["nan"] == 1 and document["tensors"][0]["max"] == 1.0


def test_spooled_stdin_is_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tensorfile.tempfile, "tempdir", str(tmp_path))
    assert invoke("inspect", "-", input=WORKED.read_bytes()).exit_code == 0
    assert invoke("inspect", "-", input=b"garbage").exit_code == 2
    assert list(tmp_path.iterdir()) == []


def test_a_bug_still_gives_one_line_and_exit_2(monkeypatch):
    """The backstop: an unexpected exception is one 'internal error' line, not a traceback."""
    from maskln_cli.jobs import inspect as stats

    def broken(path, *args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(stats, "summarize_file", broken)
    result = invoke("inspect", WORKED)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "internal error: ZeroDivisionError: a bug", "MASKLN_DEBUG")
    monkeypatch.setenv("MASKLN_DEBUG", "1")
    assert isinstance(invoke("inspect", WORKED).exception, ZeroDivisionError)


@pytest.mark.parametrize(
    "command",
    [
        ["inspect", WORKED],
        ["diff", WORKED, WORKED],
        ["verify", PAIRS, PAIRS.with_name("pair_features_expected.safetensors")],
    ],
)
def test_reports_to_a_full_stdout_exit_2(command):
    with open("/dev/full", "wb") as full:
        result = run(*command, stdout=full)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "cannot write")
    closed = subprocess.run(
        [sys.executable, "-m", "maskln_cli", *map(str, command)],
        capture_output=True,
        cwd=ROOT,
        bufsize=0,
    )
    assert closed.returncode in (0, 1)  # sanity: the command itself works


@pytest.mark.parametrize(
    ("other", "flags", "code"),
    [("many", "", "0"), ("other", "", "1"), ("many", "--json", "0"), ("other", "--json", "1")],
)
def test_a_report_piped_into_head_ends_quietly_with_its_verdict(tmp_path, other, flags, code):
    """As git and grep do: no message when the reader goes, and the verdict's exit code."""
    # Every report names each key at least once: 200 keys of 700 characters make it longer
    # than a pipe holds (64 KiB), so that writing it fails once head has gone.
    names = [f"{i:03d}" + "k" * 697 for i in range(200)]
    assert sum(map(len, names)) > 2 * 64 * 1024
    many = write(tmp_path / "many.safetensors", {name: torch.ones(2) for name in names})
    write(tmp_path / "other.safetensors", {name: torch.zeros(2) for name in names})
    pipeline = subprocess.run(
        f"{sys.executable} -m maskln_cli diff {many} {tmp_path / other}.safetensors {flags}"
        " | head -c 10 >/dev/null; echo ${PIPESTATUS[0]}",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert pipeline.stdout.strip() == code, pipeline.stderr
    assert pipeline.stderr == ""


@pytest.mark.parametrize(
    ("command", "target"),
    [(["verify", PAIRS, PAIRS], "maskln_cli.verify.job.verify_file"),
     (["inspect", PAIRS], "maskln_cli.jobs.inspect.summarize_file"),
     (["diff", PAIRS, PAIRS], "maskln_cli.compare.files.diff_files")],
)  # fmt: skip
def test_ctrl_c_in_a_command_that_writes_nothing_says_only_interrupted(
    monkeypatch, command, target
):
    module, name = target.rsplit(".", 1)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(module), name, interrupted)
    result = invoke(*command)
    assert result.exit_code == 130
    assert result.stderr.strip() == "maskln: error: interrupted"


def test_closed_stdin_and_stdout(tmp_path):
    closed_stdin = subprocess.run(
        f"{sys.executable} -m maskln_cli inspect - <&-", shell=True, capture_output=True, cwd=ROOT
    )
    assert closed_stdin.returncode == 2
    assert_one_line_error(closed_stdin.stderr, "<stdin>")
    closed_stdout = subprocess.run(
        f"{sys.executable} -m maskln_cli generate - --shape 2,3 >&-",
        shell=True,
        capture_output=False,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    assert closed_stdout.returncode == 2
    assert_one_line_error(closed_stdout.stderr, "<stdout>")


@pytest.mark.parametrize("shape", ["0,4", "3,0,4"])
def test_generate_with_an_empty_leading_axis(tmp_path, shape):
    output = tmp_path / "g.safetensors"
    assert invoke("generate", output, "--shape", shape).exit_code == 0
    assert read(output)["x"].shape == tuple(int(s) for s in shape.split(","))
    assert invoke("normalize", output, tmp_path / "o.safetensors").exit_code == 0
