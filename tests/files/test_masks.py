"""Valid rows only (issue 12, item 4): ``maskln diff --valid`` and ``maskln verify --valid``.

A model's own LayerNorm output is not zero on padding; compared with maskln's it differs on
exactly the padded rows. The "model" files here are the float64 reference on valid rows and
what a LayerNorm makes of the padding elsewhere: finite garbage, never 0.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from maskln_cli.compare.rows import leave_out
from maskln_cli.files.masks import parse_mask_spec
from maskln_cli.op.reference import reference_masked_layer_norm
from tests.clitools import assert_one_line_error, invoke, write

SHAPE = (3, 7, 16)


def padded_batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([7, 4, 2])
    attention_mask = (torch.arange(SHAPE[1])[None, :] < lengths[:, None]).long()
    return {
        "x": x,
        "attention_mask": attention_mask,
        "scale": 1.0 + 0.1 * torch.randn(SHAPE[-1], generator=generator, dtype=torch.float64),
        "bias": 0.1 * torch.randn(SHAPE[-1], generator=generator, dtype=torch.float64),
        "grad_out": torch.randn(SHAPE, generator=generator, dtype=torch.float64)
        * attention_mask[..., None],  # a loss over valid positions: no gradient on padding
    }


def model_like_outputs(batch, eps=1e-5):
    """What a model's own LayerNorm gives: the formula on every row, padding included."""
    x = batch["x"].requires_grad_()
    scale = batch["scale"].clone().requires_grad_()
    bias = batch["bias"].clone().requires_grad_()
    everywhere = torch.ones(SHAPE[:-1], dtype=torch.bool)
    out = reference_masked_layer_norm(x, everywhere, scale, bias, eps)
    grads = torch.autograd.grad(out, (x, scale, bias), batch["grad_out"])
    x.requires_grad_(False)
    return {
        "out": out.detach(),
        "grad_x": grads[0],
        "grad_scale": grads[1],
        "grad_bias": grads[2],
    }


@pytest.fixture
def files(tmp_path):
    batch = padded_batch()
    acts = write(tmp_path / "acts.safetensors", batch)
    model = model_like_outputs(batch)
    dump = write(tmp_path / "model_layer.safetensors", model)
    ours = tmp_path / "ours.safetensors"
    result = invoke("normalize", acts, ours, "--valid-key", "attention_mask")
    assert result.exit_code == 0, result.stderr
    padded_rows = int((batch["attention_mask"] == 0).sum())
    return acts, dump, ours, padded_rows


def test_diff_fails_on_exactly_the_padded_rows_without_valid(files):
    _, dump, ours, padded_rows = files
    document = json.loads(invoke("diff", ours, dump, "-k", "out", "--json").stdout)
    assert document["passed"] is False
    assert document["tensors"][0]["mismatched_rows"] == padded_rows


def test_diff_valid_compares_valid_rows_only_and_says_how_many_were_left_out(files):
    acts, dump, ours, padded_rows = files
    spec = f"{acts}:attention_mask"
    result = invoke("diff", ours, dump, "--valid", spec, "--json")
    assert result.exit_code == 0, result.stdout
    document = json.loads(result.stdout)
    tensors = {t["name"]: t for t in document["tensors"]}
    assert tensors["out"]["rows_left_out"] == padded_rows
    assert tensors["grad_x"]["rows_left_out"] == padded_rows
    assert tensors["grad_scale"]["rows_left_out"] is None  # [C]: compared in full
    rows = SHAPE[0] * SHAPE[1]
    assert document["notes"] == [
        f"--valid {spec}: compared {rows - padded_rows} of {rows} rows of out, grad_x;"
        " in full: grad_scale, grad_bias"
    ]
    human = invoke("diff", ours, dump, "--valid", spec)
    assert human.exit_code == 0
    assert re.search(rf"left out +{padded_rows} rows \(--valid\)", human.stdout)


def test_diff_valid_still_finds_a_wrong_valid_row(tmp_path, files):
    acts, _, ours, padded_rows = files
    model = model_like_outputs(padded_batch())
    model["out"][1, 2, 5] += 1e-3  # row [1, 2] is valid (length 4)
    wrong = write(tmp_path / "wrong.safetensors", model)
    result = invoke("diff", ours, wrong, "--valid", f"{acts}:attention_mask", "-k", "out")
    assert result.exit_code == 1
    valid_rows = SHAPE[0] * SHAPE[1] - padded_rows
    assert f"1 of {valid_rows * SHAPE[2]:,}" in result.stdout
    assert f"in 1 of {valid_rows} rows" in result.stdout
    document = json.loads(
        invoke(
            "diff", ours, wrong, "--valid", f"{acts}:attention_mask", "-k", "out", "--json"
        ).stdout
    )
    out = document["tensors"][0]
    assert out["mismatched"] == 1 and out["worst"][0]["row"] == [1, 2]
    assert out["mismatched_fraction"] == pytest.approx(1 / (valid_rows * SHAPE[2]))
    compared = valid_rows * SHAPE[2]
    assert out["problems"] == [f"1 of {compared:,} compared elements differ beyond tolerance"]


def test_valid_file_default_key_and_bool_mask(tmp_path, files):
    _, dump, ours, padded_rows = files
    mask = write(tmp_path / "mask.safetensors", {"valid": padded_batch()["attention_mask"].bool()})
    result = invoke("diff", ours, dump, "--valid", mask, "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["tensors"][0]["rows_left_out"] == padded_rows


@pytest.mark.parametrize(
    ("mask", "fragments"),
    [
        (
            torch.ones(2, 7, dtype=torch.bool),
            ("has shape [2, 7]", "no tensor compared has shape [2, 7, C]"),
        ),
        (torch.full((3, 7), 2), ("only 0 and 1",)),
    ],
)
def test_valid_mask_that_does_not_fit(tmp_path, files, mask, fragments):
    _, dump, ours, _ = files
    path = write(tmp_path / "mask.safetensors", {"valid": mask})
    result = invoke("diff", ours, dump, "--valid", path)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, *fragments)


def test_valid_key_missing_suggests(tmp_path, files):
    acts, dump, ours, _ = files
    result = invoke("diff", ours, dump, "--valid", f"{acts}:attention_mas")
    assert result.exit_code == 2
    assert_one_line_error(
        result.stderr, "--valid: ", "no tensor 'attention_mas'", "'attention_mask'"
    )


def test_valid_file_without_the_default_key_names_the_option(tmp_path, files):
    _, dump, ours, _ = files
    path = write(tmp_path / "mask.safetensors", {"attention_mask": torch.ones(3, 7)})
    result = invoke("diff", ours, dump, "--valid", path)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "--valid: ", "no tensor 'valid'", "'attention_mask'")


def test_verify_valid_leaves_the_models_padding_out(files):
    acts, dump, _, padded_rows = files
    args = ("verify", acts, dump, "--valid-key", "attention_mask")
    failing = invoke(*args, "--json")
    assert failing.exit_code == 1  # padding is not 0 in the model's output
    spec = f"{acts}:attention_mask"
    result = invoke(*args, "--valid", spec, "--json")
    assert result.exit_code == 0, result.stdout
    tensors = {t["name"]: t for t in json.loads(result.stdout)["tensors"]}
    assert set(tensors) == {"out", "grad_x", "grad_scale", "grad_bias"}
    assert tensors["out"]["rows_left_out"] == tensors["grad_x"]["rows_left_out"] == padded_rows
    assert tensors["out"]["invalid_rows_zero"] is None  # every invalid row was left out
    human = invoke(*args, "--valid", spec)
    assert human.exit_code == 0
    assert f"{padded_rows} rows (--valid)" in human.stdout


def test_verify_valid_of_the_wrong_shape(tmp_path, files):
    acts, dump, _, _ = files
    mask = write(tmp_path / "mask.safetensors", {"valid": torch.ones(3, 6, dtype=torch.bool)})
    result = invoke("verify", acts, dump, "--valid-key", "attention_mask", "--valid", mask)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "--valid", "[3, 6]", "[3, 7]")


def test_parse_mask_spec(tmp_path):
    odd = tmp_path / "a:b.safetensors"
    odd.write_bytes(b"")
    assert parse_mask_spec(str(odd)) == (str(odd), "valid")  # an existing path is taken whole
    assert parse_mask_spec("m.safetensors:mask") == ("m.safetensors", "mask")
    assert parse_mask_spec("m.safetensors") == ("m.safetensors", "valid")


def test_leave_out_zeroes_both_sides_of_the_rows_left_out():
    actual = torch.tensor([[1.0, float("nan")], [3.0, 4.0], [5.0, 6.0]])
    expected = torch.tensor([[9.0, 9.0], [3.0, 4.0], [float("inf"), 0.0]])
    keep = torch.tensor([False, True, False])
    a, e = leave_out(actual, expected, keep)
    assert a.tolist() == [[0.0, 0.0], [3.0, 4.0], [0.0, 0.0]]
    assert e.tolist() == [[0.0, 0.0], [3.0, 4.0], [0.0, 0.0]]
    assert actual[0, 0] == 1.0  # the inputs are not modified
