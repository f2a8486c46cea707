"""docs/reference/json.md names every key the JSON outputs print: each key of `verify`, `diff`,
`inspect` and `grade --json` (the documents the page shows, which tests/docs/test_examples.py
runs), of `verify`'s keys that only some inputs print (`systematic`, `not_checked`,
`lower_precision`), and of `verify DIR --json`'s lines, is a row of its section's tables, or,
for a key inside another (`worst[].abs_diff`, `root_cause.mistake`), named in that key's row."""

from __future__ import annotations

import json
import re

from tests import kernels
from tests.clitools import ROOT, invoke, write
from tests.verify.test_verify_folder import dump

PAGE = ROOT / "docs" / "reference" / "json.md"
DATA_MAPS = {"metadata", "budget_ratios", "lower_precision.tensors"}
"""Objects whose keys are data (a file's metadata, tensor names), not names of the format."""


def sections() -> dict[str, str]:
    text = PAGE.read_text()
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def names(text: str) -> set[str]:
    """The identifiers inside the backquoted spans of ``text``."""
    return {
        name for span in re.findall(r"`([^`\n]+)`", text)
        for name in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span)
    }  # fmt: skip


def rows(text: str) -> dict[str, str]:
    """Each key a table row of ``text`` documents, and that row's text: by its path as the row
    spells it (``clauses[].name``; ``.level`` after it is ``clauses[].level``; the list
    ``clauses`` with it), and by its name alone when the row gives none. A section without a
    table documents each name it quotes, in its prose."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        cells = line.split(" | ")
        if not line.startswith("| ") or len(cells) < 2 or line.startswith("| key |"):
            continue
        parent = ""
        for span in re.findall(r"`([^`]+)`", cells[0]):
            span = span.strip()
            if span.startswith("."):
                span = parent + span[1:]
            parent = span.rpartition(".")[0]
            if parent:  # `tensors[].name` documents tensors too
                found.setdefault(parent.removesuffix("[]"), line)
                parent += "."
            found.setdefault(span.removesuffix("[]"), line)
    if not found:
        found = dict.fromkeys(names(text), text)
    return found


def undocumented(document: dict, table: dict[str, str], row: str = "", path: str = "") -> list:
    """The keys of ``document`` (and of the objects inside it) the page does not name: each
    one a row of ``table`` (by its path, or its name), or named in the row of the key holding
    it (``row``)."""
    missing: list[str] = []
    for key, value in document.items():
        where = f"{path}{key}"
        own = table.get(where) or table.get(key)
        if own is None and key not in names(row):
            missing.append(where)
            continue
        if where in DATA_MAPS:
            continue
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, dict):
                suffix = "[]." if isinstance(value, list) else "."
                missing += undocumented(child, table, own or row, f"{where}{suffix}")
    return sorted(set(missing))


def shown_documents(text: str) -> list[dict]:
    """The JSON documents the page's console blocks show after a `--json` command."""
    documents = []
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.S):
        for command in re.split(r"^\$ ", block, flags=re.M)[1:]:
            line, _, printed = command.partition("\n")
            if "--json" in line:
                documents.append(json.loads(printed))
    return documents


def test_every_key_of_the_documents_the_page_shows_is_documented():
    page = sections()
    shown = shown_documents(PAGE.read_text())
    assert [sorted(d)[0] for d in shown] == ["actual", "file", "clauses"]  # verify, inspect, grade
    verify, inspect, grade = shown
    assert undocumented(verify, rows(page["verify and diff"])) == []
    assert undocumented(inspect, rows(page["inspect"])) == []
    assert undocumented(grade, rows(page["grade"])) == []


def test_every_key_verify_prints_on_some_inputs_only_is_documented(tmp_path):
    """A systematic error, a result in a lower precision than x, too few rows: the keys only
    these print; and the lines of a folder of dumps, `left_out` among them."""
    table = rows(sections()["verify and diff"])
    inputs = kernels.offset_batch(0.0, shape=(1, 6, 64))
    source = write(tmp_path / "in.safetensors", inputs, eps="1e-05")
    documents = []
    for name, result in {
        "eps": kernels.run(kernels.with_eps(1e-3), inputs),
        "half": {"out": kernels.run(kernels.maskln, inputs)["out"].half()},
    }.items():
        target = write(tmp_path / f"{name}.safetensors", result)
        documents.append(json.loads(invoke("verify", source, target, "--json").stdout))
        documents.append(json.loads(invoke("diff", target, target, "--json").stdout))
    said = set(documents[0]) | set(documents[2]) | set(documents[0]["tensors"][0])
    assert {"not_checked", "lower_precision", "systematic"} <= said
    for document in documents:
        assert undocumented(document, table) == []

    dumps = tmp_path / "dumps"
    dumps.mkdir()
    for call in range(2):
        name, tensors = dump(dumps, call, f"layer.{call}.LayerNorm")
        del tensors["grad_scale"], tensors["grad_bias"]
        write(dumps / name, tensors, eps="1e-12", module=f"layer.{call}", call=str(call))
    lines = [json.loads(line) for line in invoke("verify", dumps, "--json").stdout.splitlines()]
    assert len(lines) == 2 and lines[0]["left_out"] == ["grad_scale", "grad_bias"]
    folder = rows(sections()["verify a folder"])
    for line in lines:
        assert undocumented({k: v for k, v in line.items() if k != "report"}, folder) == []
        assert undocumented(line["report"], table) == []


def test_an_undocumented_key_is_found():
    """The check can fail: a key the page does not name, at the top or inside another."""
    table = rows(sections()["verify and diff"])
    assert undocumented({"passed": True, "novel": 1}, table) == ["novel"]
    worst = {"tensors": [{"worst": [{"abs_diff": 0.1, "novel": 2}]}]}
    assert undocumented(worst, table) == ["tensors[].worst[].novel"]
