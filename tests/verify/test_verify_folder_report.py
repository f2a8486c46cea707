"""`maskln verify DUMPS/ [RESULTS/]` as a terminal shows it, and no silent gaps (issue 33, item
5; issue 31, item 4): the table fits 80 and 120 columns in a pseudo-terminal, every row with its
file, its verdict and what failed, unabridged; entries that are no file are rows; a name that is
not UTF-8 is read; gradients a dump holds none of are said once."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios

import pytest
import torch
from rich.cells import cell_len

from tests.clitools import ROOT, invoke, write
from tests.verify.test_verify_folder import C, dump, json_lines

MODULES = tuple(f"encoder.layer.{n}.attention.output.LayerNorm" for n in range(4))


def in_terminal(columns: int, *args: object) -> tuple[int, str]:
    """``maskln ARGS`` in a pseudo-terminal of ``columns`` columns: its exit code and what the
    terminal shows (styles taken off; stderr, the progress bar's, apart)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    environment = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    process = subprocess.Popen(
        [sys.executable, "-m", "maskln_cli", *map(str, args)],
        stdin=follower, stdout=follower, stderr=subprocess.DEVNULL, cwd=ROOT,
        env={**environment, "TERM": "xterm-256color"},
    )  # fmt: skip
    os.close(follower)
    shown = b""
    while select.select([leader], [], [], 120)[0]:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # the process closed its end
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    code = process.wait(timeout=120)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode()).replace("\r\n", "\n")
    return code, text


def eps_outside(tensors):
    """A kernel's out with eps (1e-5) outside the square root."""
    valid = tensors["valid"][..., None]
    x = torch.where(valid, tensors["x"], 0.0)
    mean = x.mean(-1, keepdim=True)
    std = (x - mean).square().mean(-1, keepdim=True).sqrt()
    out = (x - mean) / (std + 1e-5) * tensors["scale"] + tensors["bias"]
    return torch.where(valid, out, 0.0)


def correct(tensors):
    valid = tensors["valid"][..., None]
    x = torch.where(valid, tensors["x"], 0.0)
    out = torch.nn.functional.layer_norm(x, (C,), tensors["scale"], tensors["bias"], 1e-5)
    return torch.where(valid, out, 0.0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """DUMPS/ and RESULTS/: a file that passes, one whose kernel is wrong, one without a
    result, a result without a dump; in DUMPS/ a FIFO, a dangling link and a folder named
    like dumps."""
    root = tmp_path_factory.mktemp("folders")
    dumps, results = root / "dumps", root / "results"
    dumps.mkdir()
    results.mkdir()
    made = [dump(dumps, call, module, eps=1e-5, grads=False) for call, module in enumerate(MODULES)]
    for (name, tensors), kernel in zip(made[:3], (correct, eps_outside, correct), strict=True):
        write(results / name, {"out": kernel(tensors)})
    (results / made[2][0]).unlink()  # its result missing
    write(results / "99999-stray.safetensors", {"out": torch.zeros(2, 7, C)})
    write(results / made[3][0], {"out": eps_outside(made[3][1]) * 1.001})
    os.mkfifo(dumps / "00005-fifo.safetensors")
    os.symlink(root / "nowhere.safetensors", dumps / "00006-gone.safetensors")
    (dumps / "00007-folder.safetensors").mkdir()
    return dumps, results


SPECIAL = {
    "00005-fifo.safetensors": "a FIFO (named pipe), not a file",
    "00006-gone.safetensors": "a dangling symbolic link",
    "00007-folder.safetensors": "a folder, not a file",
}


@pytest.mark.parametrize("columns", [80, 120])
def test_the_folder_table_fits_the_terminal_with_every_verdict_and_what_failed(folders, columns):
    """Before: at 120 columns `…  d…  o…  v…`, at 80 no verdict column at all."""
    dumps, results = folders
    _, lines = json_lines(dumps, results)
    code, shown = in_terminal(columns, "verify", dumps, results)
    assert code == 2  # entries that are no file cannot be judged: an error of the input
    table = shown[: shown.index("\n\n", shown.index("───"))].splitlines()
    assert all(cell_len(line) <= columns for line in table), "\n".join(table)
    assert "…" not in shown
    for line in lines:
        name, passed = line["file"], line["passed"]
        row = next(i for i, text in enumerate(table) if name in text)
        verdict = "PASS" if passed else "FAIL" if line["status"] == "checked" else "FAIL: "
        assert verdict in table[row], table[row]
        folded = []
        for text in table[row + 1 :]:
            if not text.startswith("    "):
                break
            folded.append(text.strip())
        below = "".join("".join(folded).split())  # wrapped at spaces, or within a path
        if line["status"] == "checked" and not passed:
            for tensor in line["report"]["tensors"]:
                if not tensor["passed"]:  # its explanation, unabridged
                    assert "".join(tensor["explanation"].split()) in below, (tensor, below)
        elif not passed:
            assert "".join(line["problem"].split()) in below
    assert not any(line["passed"] for line in lines if line["file"] in SPECIAL)


def test_entries_that_are_no_file_are_rows_with_their_reason(folders):
    """Before: a FIFO, a dangling symbolic link or a folder named *.safetensors was skipped,
    and the folder said PASS."""
    dumps, _ = folders
    result, lines = json_lines(dumps)
    assert result.exit_code == 2
    rows = {line["file"]: line for line in lines}
    for name, reason in SPECIAL.items():
        assert (rows[name]["status"], rows[name]["passed"]) == ("error", False)
        assert reason in rows[name]["problem"] and str(dumps / name) in rows[name]["problem"]
    assert [line["passed"] for line in lines if line["file"] not in SPECIAL] == [True] * 4
    quiet = invoke("verify", dumps, "-q")
    assert quiet.stdout.startswith("FAIL: 3 of 7 files: 00005-fifo.safetensors (error)")


def test_a_dump_whose_name_is_not_utf8_is_read(tmp_path):
    """Before: 'not a valid safetensors file: Path ... is not valid UTF-8'."""
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    name, _ = dump(dumps, 0, MODULES[0], grads=False)
    odd = os.fsencode(dumps) + b"/00001-caf\xe9.safetensors"
    os.rename(os.fsencode(dumps / name), odd)
    result, lines = json_lines(dumps)
    assert result.exit_code == 0, result.stdout
    assert [(line["status"], line["passed"]) for line in lines] == [("checked", True)]
    assert lines[0]["file"] == os.fsdecode(odd).rsplit("/", 1)[1]


def test_gradients_a_dump_holds_none_of_are_said_once(tmp_path):
    """Dumps of a model whose parameters did not require grad: grad_out and grad_x, no
    grad_scale or grad_bias. Before: a failing 'missing in RESULT' block per tensor per file."""
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    for call, module in enumerate(MODULES[:3]):
        name, tensors = dump(dumps, call, module)
        del tensors["grad_scale"], tensors["grad_bias"]
        write(dumps / name, tensors, eps="1e-12", module=module, call=str(call))
    result, lines = json_lines(dumps)
    assert result.exit_code == 0
    assert all(line["left_out"] == ["grad_scale", "grad_bias"] for line in lines)
    assert all(sorted(line["budget_ratios"]) == ["grad_x", "out"] for line in lines)
    shown = invoke("verify", dumps).stdout
    assert "missing" not in shown
    assert shown.count("grad_scale and grad_bias: not checked in 3 of 3 dumps") == 1
    assert json.loads(invoke("verify", dumps, "--json").stdout.splitlines()[0])["passed"]
