"""Files that are read are never written, and no way of dying leaves a file behind.

- Every file a command reads (INPUT, --params and each shard of its index, --config,
  --grad-out), reached by any path (folder, index, hard link, symlink, stdout redirection), is
  refused as OUTPUT, and left as it was.
- kill -9 while an output is written, or while stdin is spooled, leaves nothing behind.
- An input truncated while it is read (SIGBUS on its mapping) ends the command with one line
  naming it and exit 2, not a silent exit 135, and leaves nothing behind.

The processes here are real: a signal or a fault must be met as a user meets it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from maskln_cli.files import shrinking
from tests.clitools import (
    ROOT,
    assert_one_line_error,
    invoke,
    run,
    write,
    writing_into,
)

# In `make test-slow` (CI), not `make test`: real processes killed and files truncated mid-read.
pytestmark = pytest.mark.slow

C = 8


def _input(folder: Path) -> Path:
    x = torch.randn(3, 5, C, generator=torch.Generator().manual_seed(0))
    return write(folder / "in.safetensors", {"x": x, "valid": torch.rand(3, 5) > 0.3})


def _layer_norm(prefix: str = "ln") -> dict[str, torch.Tensor]:
    return {f"{prefix}.weight": torch.rand(C) + 0.5, f"{prefix}.bias": torch.randn(C)}


def _model_folder(folder: Path) -> Path:
    model = folder / "model"
    model.mkdir()
    write(model / "model.safetensors", _layer_norm())
    (model / "config.json").write_text(json.dumps({"layer_norm_eps": 1e-12}))
    return model


def _sharded_folder(folder: Path) -> Path:
    model = folder / "sharded"
    model.mkdir()
    write(model / "model-00001-of-00002.safetensors", _layer_norm("a"))
    write(model / "model-00002-of-00002.safetensors", _layer_norm("b"))
    weight_map = {
        "a.weight": "model-00001-of-00002.safetensors",
        "a.bias": "model-00001-of-00002.safetensors",
        "b.weight": "model-00002-of-00002.safetensors",
        "b.bias": "model-00002-of-00002.safetensors",
    }
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return model


def _aliasing_case(case: str, tmp_path: Path) -> tuple[Path, list[str], str]:
    """(OUTPUT, options, the option the message must name) for each way to alias a read file."""
    if case == "params folder, its weights file":
        model = _model_folder(tmp_path)
        return model / "model.safetensors", ["--params", str(model), "--module", "ln"], "--params"
    if case == "params index, a shard it does not use":
        model = _sharded_folder(tmp_path)
        index = model / "model.safetensors.index.json"
        output = model / "model-00002-of-00002.safetensors"
        return output, ["--params", str(index), "--module", "a"], "--params"
    if case == "params index, the index itself":
        model = _sharded_folder(tmp_path)
        index = model / "model.safetensors.index.json"
        return index, ["--params", str(index), "--module", "a"], "--params"
    if case == "config folder, its config.json":
        model = _model_folder(tmp_path)
        return model / "config.json", ["--config", str(model)], "--config"
    if case == "config file":
        config = tmp_path / "cfg.json"
        config.write_text(json.dumps({"layer_norm_eps": 1e-6}))
        return config, ["--config", str(config)], "--config"
    if case == "grad-out file":
        grad = write(tmp_path / "g.safetensors", {"grad_out": torch.randn(3, 5, C)})
        return grad, ["--grad-out", str(grad)], "--grad-out"
    if case == "a hard link to the params file":
        model = _model_folder(tmp_path)
        link = tmp_path / "elsewhere.safetensors"
        os.link(model / "model.safetensors", link)
        return link, ["--params", str(model / "model.safetensors"), "--module", "ln"], "--params"
    if case == "a symlink to the config":
        model = _model_folder(tmp_path)
        link = tmp_path / "link.json"
        link.symlink_to(model / "config.json")
        return link, ["--config", str(model / "config.json")], "--config"
    raise AssertionError(case)


ALIASING = [
    "params folder, its weights file",
    "params index, a shard it does not use",
    "params index, the index itself",
    "config folder, its config.json",
    "config file",
    "grad-out file",
    "a hard link to the params file",
    "a symlink to the config",
]


@pytest.mark.parametrize("case", ALIASING)
def test_a_file_read_through_an_option_is_refused_as_output(tmp_path, case):
    source = _input(tmp_path)
    output, options, option = _aliasing_case(case, tmp_path)
    before = output.read_bytes()
    result = invoke("normalize", source, output, *options)
    assert result.exit_code == 2, result.stdout
    assert_one_line_error(result.stderr, str(output), option, "write the output elsewhere")
    assert output.read_bytes() == before


@pytest.mark.parametrize("case", ["params folder, its weights file", "config file"])
def test_out_dir_refuses_a_read_file_too(tmp_path, case):
    """--out-dir DIR writes DIR/<INPUT's name>: an input named as a file read in DIR."""
    output, options, option = _aliasing_case(case, tmp_path)
    (tmp_path / "inputs").mkdir()
    source = _input(tmp_path).rename(tmp_path / "inputs" / output.name)
    before = output.read_bytes()
    result = invoke("normalize", source, *options, "--out-dir", output.parent)
    assert result.exit_code == 2, result.stdout
    assert option in result.stderr and output.read_bytes() == before


def test_stdout_redirected_into_a_params_file_is_refused(tmp_path):
    source = _input(tmp_path)
    model = _model_folder(tmp_path)
    weights = model / "model.safetensors"
    before = weights.read_bytes()
    with open(weights, "ab") as appended:  # ">>": the shell did not truncate it
        result = run("normalize", source, "-", "--params", model, "--module", "ln", stdout=appended)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "<stdout>", "--params", "write the output elsewhere")
    assert weights.read_bytes() == before


def test_the_files_a_command_reads_stay_writable_by_another_call(tmp_path):
    """Only this command's own reads are refused: a file read by an earlier call in the same
    process may be written by a later one."""
    source = _input(tmp_path)
    model = _model_folder(tmp_path)
    first = invoke(
        "normalize", source, tmp_path / "a.safetensors", "--params", model, "--module", "ln"
    )
    assert first.exit_code == 0, first.stderr
    again = invoke("normalize", tmp_path / "a.safetensors", source, "--x-key", "out")
    assert again.exit_code == 0, again.stderr


# --- kill -9 and SIGBUS --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def large_input(tmp_path_factory) -> Path:
    """A 64 MiB input: its output, written in chunks of two rows, takes many seconds."""
    path = tmp_path_factory.mktemp("large") / "large.safetensors"
    assert run("generate", path, "--shape", "131072,128", "--quiet").returncode == 0
    return path


def _start(*args: object, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "maskln_cli", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        **kwargs,
    )


def _wait_until(condition, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_kill_9_while_writing_leaves_nothing_beside_the_output(tmp_path, large_input):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "out.safetensors").write_bytes(b"the previous result")
    process = _start("normalize", large_input, folder / "out.safetensors", "--chunk-rows", "2")
    _wait_until(lambda: writing_into(process.pid, folder), process)
    process.kill()
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert sorted(p.name for p in folder.iterdir()) == ["out.safetensors"]
    assert (folder / "out.safetensors").read_bytes() == b"the previous result"


def test_kill_9_while_stdin_is_spooled_leaves_nothing_in_tmpdir(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    process = _start(
        "normalize",
        "-",
        tmp_path / "out.safetensors",
        stdin=subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(spool)},
    )
    process.stdin.write(b"\0" * (4 << 20))  # spooling has begun; stdin stays open
    process.stdin.flush()
    _wait_until(lambda: writing_into(process.pid, spool), process)
    process.kill()
    process.communicate(timeout=60)
    assert list(spool.iterdir()) == []
    assert not (tmp_path / "out.safetensors").exists()


@pytest.fixture(scope="module")
def input_and_result(tmp_path_factory) -> tuple[Path, Path]:
    """A 16 MiB input and its result: read two rows at a time, they take seconds."""
    folder = tmp_path_factory.mktemp("truncated")
    source, result = folder / "big.safetensors", folder / "result.safetensors"
    assert run("generate", source, "--shape", "32768,128", "--quiet").returncode == 0
    assert run("normalize", source, result, "--quiet").returncode == 0
    return source, result


@pytest.mark.parametrize("command", ["normalize", "verify"])
def test_an_input_truncated_while_read_is_one_line_and_exit_2(tmp_path, input_and_result, command):
    source = Path(shutil.copy(input_and_result[0], tmp_path / "big.safetensors"))
    folder = tmp_path / "out"
    folder.mkdir()
    if command == "normalize":
        process = _start("normalize", source, folder / "out.safetensors", "--chunk-rows", "2")
        _wait_until(lambda: writing_into(process.pid, folder), process)
    else:
        result = input_and_result[1]
        process = _start("verify", source, result, "--chunk-rows", "2", "--quiet")
        # Both files open means both headers were read: verify is reading rows.
        _wait_until(
            lambda: _has_open(process.pid, source) and _has_open(process.pid, result), process
        )
        time.sleep(0.5)
    os.truncate(source, 4096)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2, stderr
    assert_one_line_error(stderr, f"{source}: the file shrank while it was being read")
    if command == "normalize":
        assert "the output was not written" in stderr.decode()
        assert list(folder.iterdir()) == []


def _has_open(pid: int, path: Path) -> bool:
    try:
        return any(
            os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd")
        )
    except OSError:
        return False


def test_shrunk_names_a_watched_file_that_shrank(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    with open(path, "rb") as file, shrinking.watch("f-as-named", file.fileno()):
        assert shrinking.shrunk() == []
        os.truncate(path, 10)
        assert shrinking.shrunk() == ["f-as-named"]
    assert shrinking.shrunk() == []


_MANY_THREADS_FAULT = """
import mmap, os, sys, threading
import torch
from maskln_cli.files import shrinking
shrinking.install_handler()
path = sys.argv[1]
with open(path, "wb") as f:
    f.write(b"\\1" * (64 << 20))
f = open(path, "rb")
mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
with shrinking.watch(path, f.fileno()):
    os.truncate(path, 4096)
    data = torch.frombuffer(mapping, dtype=torch.uint8)[4096:]
    start = threading.Barrier(8)
    def touch(part):
        start.wait()
        part.sum()
    threads = [threading.Thread(target=touch, args=(p,)) for p in data.chunk(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
print("not reached")
"""


@pytest.mark.parametrize("attempt", range(3))
def test_threads_faulting_together_print_one_line(tmp_path, attempt):
    # verify reads one mapping from several threads: each faults, and each used to print the
    # message before the first one's _exit (about half the runs of this script, before the fix).
    path = tmp_path / "mapped"
    process = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _MANY_THREADS_FAULT, str(path)],
        capture_output=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )
    assert process.returncode == 2, process.stderr
    assert_one_line_error(process.stderr, f"{path}: the file shrank while it was being read")
