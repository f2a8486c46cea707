"""`maskln verify -q`: the one-line verdict names every failing aspect of a tensor, its
padding's as well as its values' (issue 37's leftovers: a named cause used to drop the padding
not zeroed)."""

from __future__ import annotations

import json

import torch

from maskln_cli.jobs.generate import generate_inputs
from tests import kernels
from tests.clitools import invoke, write


def _verdicts(tmp_path, inputs, result):
    source = write(tmp_path / "in.safetensors", inputs, eps="1e-05")
    target = write(tmp_path / "result.safetensors", result)
    document = json.loads(invoke("verify", source, target, "--json").stdout)
    quiet = invoke("verify", source, target, "-q")
    assert quiet.exit_code == 1, quiet.stderr
    return {t["name"]: t for t in document["tensors"]}, quiet.stdout.strip()


def _padding_of_ones(result, valid):
    return {"out": torch.where(valid[..., None], result["out"], 1.0)}


def test_a_named_cause_keeps_the_padding_in_the_quiet_line(tmp_path):
    inputs = generate_inputs((8, 64, 64), "float32", 1, invalid=0.3)
    result = _padding_of_ones(kernels.run(kernels.with_eps(1e-3), inputs), inputs["valid"])
    tensors, quiet = _verdicts(tmp_path, inputs, result)
    invalid = int((~inputs["valid"]).sum())
    assert f"{invalid} of {invalid} invalid rows not zeroed" in tensors["out"]["problems"]
    assert "RESULT's eps ≈ 0.001" in quiet  # the cause of the values
    assert f"{invalid} of {invalid} invalid rows not zeroed" in quiet  # and the padding


def test_an_unnamed_error_keeps_both_aspects_in_the_quiet_line(tmp_path):
    inputs = generate_inputs((8, 64, 64), "float32", 1, invalid=0.3)
    result = kernels.run(kernels.two_pass, inputs)
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(result["out"].shape, generator=g) * 1e-3  # no known mistake: noise
    result = _padding_of_ones({"out": result["out"] + noise}, inputs["valid"])
    tensors, quiet = _verdicts(tmp_path, inputs, result)
    problems = tensors["out"]["problems"]
    assert any("invalid rows not zeroed" in p for p in problems)
    assert any(("valid rows" in p and "beyond" in p) or "valid rows off" in p for p in problems)
    assert "invalid rows not zeroed" in quiet
    assert "valid rows off" in quiet or "valid rows beyond" in quiet, quiet


def test_padding_alone_is_said_once(tmp_path):
    inputs = generate_inputs((8, 64, 64), "float32", 1, invalid=0.3)
    result = _padding_of_ones(kernels.run(kernels.two_pass, inputs), inputs["valid"])
    _, quiet = _verdicts(tmp_path, inputs, result)
    assert quiet.count("not zeroed") == 1, quiet
