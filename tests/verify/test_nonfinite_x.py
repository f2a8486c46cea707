"""NaN or inf in x's valid rows (issue 37's leftovers): the truth is NaN in those rows, so a
kernel that is NaN there too passes, but a PASS must say what it checked: how many valid rows
were only checked to be NaN, in the verdict line and the JSON; `maskln normalize` notes them."""

from __future__ import annotations

import json

import torch

from maskln_cli.jobs.generate import generate_inputs
from tests import kernels
from tests.clitools import invoke, write


def _poisoned_valid_rows(grad: bool = False):
    inputs = generate_inputs((4, 16, 64), "float32", 3, invalid=0.25, grad=grad)
    valid = inputs["valid"]
    rows = valid.nonzero()[:3].tolist()  # three valid rows: NaN, +inf, -inf in one element
    for (i, j), value in zip(rows, (float("nan"), float("inf"), float("-inf")), strict=True):
        inputs["x"][i, j, 5] = value
    return inputs, int(valid.sum())


def _judge(tmp_path, inputs, result):
    source = write(tmp_path / "in.safetensors", inputs, eps="1e-05")
    target = write(tmp_path / "result.safetensors", result)
    done = invoke("verify", source, target, "--json")
    assert done.exit_code in (0, 1), done.stderr
    quiet = invoke("verify", source, target, "-q")
    loud = invoke("verify", source, target)
    return json.loads(done.stdout), quiet.stdout, loud.stdout


def test_a_pass_says_how_many_valid_rows_hold_nonfinite_x(tmp_path):
    inputs, valid_rows = _poisoned_valid_rows()
    result = kernels.run(kernels.two_pass, inputs)
    assert bool(result["out"].isnan().any(-1).sum() == 3)  # the kernel is NaN there, as the truth
    document, quiet, loud = _judge(tmp_path, inputs, result)
    assert document["passed"]
    assert document["nonfinite_x_rows"] == 3
    phrase = f"3 of {valid_rows:,} valid rows hold NaN or inf in x"
    assert any(phrase in line for line in document["not_checked"]), document["not_checked"]
    assert phrase in quiet and phrase in loud


def test_finite_x_says_nothing_of_it(tmp_path):
    inputs = generate_inputs((4, 16, 64), "float32", 3, invalid=0.25, poison=True)
    result = kernels.zero_padding(kernels.run(kernels.two_pass, inputs), inputs["valid"])
    document, quiet, _ = _judge(tmp_path, inputs, result)
    assert document["passed"] and document["nonfinite_x_rows"] == 0
    assert "NaN or inf in x" not in quiet


def test_with_gradients_the_rows_are_said_too(tmp_path):
    inputs, valid_rows = _poisoned_valid_rows(grad=True)
    result = kernels.run(kernels.two_pass, inputs)
    document, quiet, _ = _judge(tmp_path, inputs, result)
    assert document["nonfinite_x_rows"] == 3
    assert f"3 of {valid_rows:,} valid rows hold NaN or inf in x" in quiet


def test_normalize_notes_valid_rows_with_nonfinite_x(tmp_path):
    inputs, valid_rows = _poisoned_valid_rows()
    source = write(tmp_path / "in.safetensors", inputs, eps="1e-05")
    done = invoke("normalize", source, tmp_path / "out.safetensors")
    assert done.exit_code == 0, done.stderr
    assert f"3 of {valid_rows:,} valid rows hold NaN or inf in x" in done.stderr
    finite = generate_inputs((4, 16, 64), "float32", 3, invalid=0.25, poison=True)
    source = write(tmp_path / "finite.safetensors", finite, eps="1e-05")
    done = invoke("normalize", source, tmp_path / "finite_out.safetensors")
    assert done.exit_code == 0 and "NaN or inf in x" not in done.stderr
    assert torch.isfinite(x := finite["x"]).any() and x.numel()  # the case is a real one
