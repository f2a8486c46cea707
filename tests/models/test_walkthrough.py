"""docs-notes/models.md, the transformers walk-through (issue 26, item 4), runs as written.

Every code block runs in order in an empty folder (see tests/models/walkthrough.py): the
python blocks in one namespace, the console blocks as commands; what a block shows it prints
must be what it prints.
"""

from __future__ import annotations

import torch

from tests.clitools import ROOT
from tests.models.walkthrough import matches, steps

DOCUMENT = ROOT / "docs-notes" / "models.md"


def test_every_block_runs_and_prints_what_the_page_shows(tmp_path, monkeypatch):
    from transformers.utils import logging

    from tests.models.walkthrough import run_step

    logging.disable_progress_bar()
    torch._dynamo.reset()
    monkeypatch.chdir(tmp_path)
    found = steps(DOCUMENT.read_text())
    assert (
        sum(s.kind == "python" for s in found) >= 8 and sum(s.kind == "console" for s in found) >= 5
    )
    namespace: dict[str, object] = {}
    for step in found:
        printed = run_step(step, namespace, tmp_path)
        if step.shown is not None:
            assert matches(step.shown, printed), f"{DOCUMENT.name}, line {step.line}:\n{printed}"
    assert len(list((tmp_path / "bert-tiny").glob("model-*-of-*.safetensors"))) > 1  # sharded


def test_what_a_block_shows_must_be_what_it_prints():
    assert matches("a\n...\nz\n", "a\nb\nc\nz\n")
    assert matches("version ...\n", "version 2.13.0+cpu\n")
    assert not matches("a\nz\n", "a\nb\nz\n")
    assert not matches("PASS\n", "FAIL\n")
    assert not matches("a ... z\n", "a b\nz\n")  # ... in a line stays in the line
    document = (
        "```python\nprint(1)\n```\n\n```text\n1\n```\n\n```console\n$ echo a \\\n  b\na b\n```\n"
    )
    python, console = steps(document)
    assert (python.code, python.shown) == ("print(1)\n", "1\n")
    assert (console.code, console.shown) == ("echo a \\\n  b\n", "a b\n")
