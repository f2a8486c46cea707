"""Fuzzing outputs that alias an input: whatever option reads a file, and whatever path names it
as OUTPUT, normalize refuses it (exit 2, one line) and every file read is left as it was.

Hypothesis draws which files the command reads (INPUT, --params as a file, a folder or an index
with shards, --config as a file or a folder, --grad-out), which of them OUTPUT aliases, and how
OUTPUT reaches it: the same path, ``./``, ``dir/../dir``, ``/proc/self/cwd``, a symlink, a hard
link, or ``--out-dir`` with an input of the same name. ``MASKLN_FUZZ_EXAMPLES`` sets the count.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from tests.clitools import assert_one_line_error, invoke, write

EXAMPLES = int(os.environ.get("MASKLN_FUZZ_EXAMPLES", "25"))
C = 4


@contextlib.contextmanager
def _inside(folder: Path) -> Iterator[None]:
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def _scenario(root: Path, params: str, config: str, grad: bool) -> tuple[list[str], list[Path]]:
    """The options of a normalize call, and every file it reads (INPUT first)."""
    x = torch.randn(2, 3, C, generator=torch.Generator().manual_seed(1))
    read = [write(root / "in.safetensors", {"x": x, "valid": torch.ones(2, 3, dtype=torch.bool)})]
    options: list[str] = []
    norm = {"ln.weight": torch.ones(C), "ln.bias": torch.zeros(C)}
    if params == "file":
        read.append(write(root / "p.safetensors", norm))
        options += ["--params", "p.safetensors", "--module", "ln"]
    elif params == "folder":
        (root / "m").mkdir()
        read.append(write(root / "m" / "model.safetensors", norm))
        options += ["--params", "m", "--module", "ln"]
    elif params == "index":
        (root / "s").mkdir()
        shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        read.append(write(root / "s" / shards[0], norm))
        read.append(write(root / "s" / shards[1], {"other.weight": torch.ones(C)}))
        index = root / "s" / "model.safetensors.index.json"
        weight_map = {"ln.weight": shards[0], "ln.bias": shards[0], "other.weight": shards[1]}
        index.write_text(json.dumps({"weight_map": weight_map}))
        read.append(index)
        options += ["--params", "s/model.safetensors.index.json", "--module", "ln"]
    if config == "file":
        (root / "cfg.json").write_text(json.dumps({"layer_norm_eps": 1e-6}))
        read.append(root / "cfg.json")
        options += ["--config", "cfg.json"]
    elif config == "folder":
        (root / "c").mkdir()
        (root / "c" / "config.json").write_text(json.dumps({"layer_norm_eps": 1e-6}))
        read.append(root / "c" / "config.json")
        options += ["--config", "c"]
    if grad:
        read.append(write(root / "g.safetensors", {"grad_out": torch.randn(2, 3, C)}))
        options += ["--grad-out", "g.safetensors"]
    return options, read


def _reach(root: Path, target: Path, how: str) -> str:
    """A path to ``target`` (inside ``root``, the working folder) written ``how``."""
    relative = target.relative_to(root)
    if how == "same":
        return str(relative)
    if how == "dot":
        return f"./{relative}"
    if how == "updown":
        return str(Path(relative.parts[0]) / ".." / relative) if relative.parts else str(relative)
    if how == "proc":
        return f"/proc/self/cwd/{relative}"
    if how == "absolute":
        return str(target)
    link = root / "links"
    link.mkdir(exist_ok=True)
    made = link / f"{how}-{target.name}"
    if how == "symlink":
        made.symlink_to(target)
    else:
        os.link(target, made)
    return str(made.relative_to(root))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    params=st.sampled_from(["none", "file", "folder", "index"]),
    config=st.sampled_from(["none", "file", "folder"]),
    grad=st.booleans(),
    how=st.sampled_from(["same", "dot", "updown", "proc", "absolute", "symlink", "hardlink"]),
    out_dir=st.booleans(),
    data=st.data(),
)
def test_fuzz_an_output_aliasing_any_read_file_is_refused(params, config, grad, how, out_dir, data):
    root = Path(tempfile.mkdtemp(prefix="maskln-alias-"))
    try:
        options, read = _scenario(root, params, config, grad)
        victim = data.draw(st.sampled_from(read), label="aliased file")
        before = {path: path.read_bytes() for path in read}
        with _inside(root):
            if out_dir and victim != read[0]:
                # INPUT, named as the victim, written into the victim's folder
                (root / "elsewhere").mkdir()
                shutil.copy(read[0], root / "elsewhere" / victim.name)
                folder = _reach(root, victim.parent, "dot" if how == "hardlink" else "same")
                args = [f"elsewhere/{victim.name}", *options, "--out-dir", folder]
            else:
                args = ["in.safetensors", _reach(root, victim, how), *options]
            note(f"maskln normalize {' '.join(args)}")
            result = invoke("normalize", *args)
        assert result.exit_code == 2, (result.stdout, result.stderr)
        assert_one_line_error(result.stderr, "write the output elsewhere")
        assert {path: path.read_bytes() for path in read} == before
    finally:
        shutil.rmtree(root, ignore_errors=True)
