"""`maskln verify DUMPS/ [RESULTS/]`: a folder of LayerNorm dumps, a verdict per file, shards
(issue 26, item 2). Dumps are written here as the capture describes them: x, valid, scale, bias,
the module's own out, optionally grad_out and its gradients; metadata eps, module, call, dtype.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.clitools import assert_one_line_error, invoke, write

C = 32
MODULES = (
    "encoder.layer.0.attention.output.LayerNorm",
    "encoder.layer.0.output.LayerNorm",
    "encoder.layer.1.attention.output.LayerNorm",
)


def dump(folder, call, module, eps=1e-12, plain=True, grads=True, seed=0, **extra):
    """One LayerNorm call as the capture writes it: a model's nn.LayerNorm (``plain``: its
    padding normalized too) or a MaskedLayerNorm (padding 0), its gradients by autograd."""
    g = torch.Generator().manual_seed(seed + call)
    x = (torch.randn(2, 7, C, generator=g) * 3 + 1).requires_grad_()
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, 4:] = False
    scale = (1 + 0.1 * torch.randn(C, generator=g)).requires_grad_()
    bias = (0.1 * torch.randn(C, generator=g)).requires_grad_()
    if plain:
        out = F.layer_norm(x, (C,), scale, bias, eps)
    else:
        kept = torch.where(valid[..., None], x, 0.0)
        out = torch.where(valid[..., None], F.layer_norm(kept, (C,), scale, bias, eps), 0.0)
    tensors = {"x": x, "valid": valid, "scale": scale, "bias": bias, "out": out}
    if grads:
        grad_out = torch.randn(2, 7, C, generator=g)
        found = torch.autograd.grad(out, (x, scale, bias), grad_out)
        tensors.update(grad_out=grad_out, grad_x=found[0], grad_scale=found[1], grad_bias=found[2])
    tensors = {k: v.detach() for k, v in tensors.items()}
    name = f"{call:05d}-{module}.safetensors"
    meta = {"eps": repr(eps), "module": module, "call": str(call), "dtype": "float32", **extra}
    write(folder / name, tensors, **meta)
    return name, tensors


def json_lines(*args):
    result = invoke("verify", *args, "--json")
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    return result, lines


def test_a_folder_of_dumps_is_judged_file_by_file_against_each_dumps_own_out(tmp_path):
    """Each dump's own out and gradients, with its own eps (1e-12: the default 1e-5 would
    fail these rows of spread 3), a model's padding as a model leaves it."""
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    dump(dumps, 0, MODULES[0])  # nn.LayerNorm: padding normalized
    dump(dumps, 1, MODULES[1], plain=False, grads=False)  # MaskedLayerNorm, forward only
    result, lines = json_lines(dumps)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert [line["module"] for line in lines] == list(MODULES[:2])
    first, second = lines
    assert (first["rows"], first["valid_rows"], first["dtype"]) == (14, 11, "float32")
    assert first["plain_layer_norm"] and not second["plain_layer_norm"]
    assert sorted(first["budget_ratios"]) == ["grad_bias", "grad_scale", "grad_x", "out"]
    assert list(second["budget_ratios"]) == ["out"]
    for line in lines:
        assert line["passed"] and line["status"] == "checked"
        assert all(0 < ratio < 1 for ratio in line["budget_ratios"].values())
        assert line["report"]["eps"] == 1e-12
    # A dump whose own out is wrong in its valid rows fails, named in the table.
    name, tensors = dump(dumps, 2, MODULES[2])
    tensors["out"] = tensors["out"] * (1 + 1e-3)
    write(dumps / name, tensors, eps="1e-12", module=MODULES[2], call="2")
    result = invoke("verify", dumps)
    assert result.exit_code == 1
    assert MODULES[2] in result.stdout.splitlines()[-1]
    assert "FAIL" in next(line for line in result.stdout.splitlines() if name in line)


def test_a_kernels_results_are_paired_by_name_and_missing_or_extra_files_fail(tmp_path):
    dumps, results = tmp_path / "dumps", tmp_path / "results"
    dumps.mkdir()
    results.mkdir()
    made = [dump(dumps, call, module, eps=1e-5) for call, module in enumerate(MODULES)]
    for (name, tensors), eps in zip(made[:2], (1e-5, 1e-3), strict=True):
        valid = tensors["valid"][..., None]
        kept = torch.where(valid, tensors["x"], 0.0)
        out = F.layer_norm(kept, (C,), tensors["scale"], tensors["bias"], eps)
        write(results / name, {"out": torch.where(valid, out, 0.0)})
    write(results / "99999-stray.safetensors", {"out": torch.zeros(2, 7, C)})
    result, lines = json_lines(dumps, results, "--check", "out")
    assert result.exit_code == 1
    verdicts = {line["file"]: (line["status"], line["passed"]) for line in lines}
    assert verdicts == {
        made[0][0]: ("checked", True),
        made[1][0]: ("checked", False),  # eps 1e-3 for 1e-5
        made[2][0]: ("missing", False),
        "99999-stray.safetensors": ("extra", False),
    }
    assert not lines[0]["plain_layer_norm"]  # a kernel's result: padding must be 0
    shown = invoke("verify", dumps, results, "--check", "out")
    assert shown.exit_code == 1
    verdict = shown.stdout.splitlines()[-1]
    assert verdict.startswith("FAIL: 3 of 4 files: ") and MODULES[1] in verdict
    assert "(missing)" in verdict and "99999-stray.safetensors (extra)" in verdict
    assert f"{results} has no {made[2][0]}" in shown.stdout


def test_shards_are_deterministic_slices_whose_json_lines_concatenate(tmp_path):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    for call in range(5):
        dump(dumps, call, MODULES[call % 3], grads=False)
    whole, lines = json_lines(dumps)
    assert whole.exit_code == 0 and len(lines) == 5
    pieces = [invoke("verify", dumps, "--json", "--shard", f"{k}/3") for k in (1, 2, 3)]
    assert all(piece.exit_code == 0 for piece in pieces)
    assert [len(piece.stdout.splitlines()) for piece in pieces] == [1, 2, 2]
    assert "".join(piece.stdout for piece in pieces) == whole.stdout
    empty = invoke("verify", dumps, "--shard", "1/8")  # 5 files, 8 slices: the first is empty
    assert empty.exit_code == 0 and "no file in this shard (shard 1/8 of 5)" in empty.stdout


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("--shard", "0/3"), ("--shard '0/3'", "1 <= K <= N")),
        (("--shard", "x"), ("--shard 'x'", "K/N")),
        (("--valid", "m.safetensors"), ("--valid", "each dump holds its own valid")),
        (("--params", "ckpt"), ("--params", "each dump holds its own")),
    ],
)
def test_folder_option_errors_exit_2(tmp_path, args, fragments):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    dump(dumps, 0, MODULES[0], grads=False)
    result = invoke("verify", dumps, *args)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, *fragments)


def test_folder_and_file_mixes_and_empty_folders_are_errors(tmp_path):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    result = invoke("verify", dumps)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "no .safetensors files to verify")
    name, _ = dump(dumps, 0, MODULES[0], grads=False)
    for args, fragment in (
        ((dumps, dumps / name), "must be a folder of results"),
        ((dumps / name, dumps), "a folder, while INPUT"),
        ((dumps / name,), "RESULT is missing"),
        ((dumps / name, dumps / name, "--shard", "1/2"), "only with a folder of dumps"),
    ):
        result = invoke("verify", *args)
        assert result.exit_code == 2, args
        assert_one_line_error(result.stderr, fragment)


def test_a_file_that_cannot_be_judged_is_reported_and_the_others_still_are(tmp_path):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    dump(dumps, 0, MODULES[0], grads=False)
    (dumps / "00001-broken.safetensors").write_bytes(b"not a safetensors file")
    result, lines = json_lines(dumps)
    assert result.exit_code == 2  # an input that cannot be read: exit 2, as for one file
    assert [(line["status"], line["passed"]) for line in lines] == [
        ("checked", True),
        ("error", False),
    ]
    assert "00001-broken.safetensors" in lines[1]["problem"]
    # With RESULTS: the broken dump has no result either; its row says missing, nothing stops.
    results = tmp_path / "results"
    results.mkdir()
    result, lines = json_lines(dumps, results)
    assert result.exit_code == 1
    assert [line["status"] for line in lines] == ["missing", "missing"]


def test_the_dumps_padding_metadata_says_which_layer_norm_made_it(tmp_path):
    """capture's metadata ``padding``: ``normalized`` (nn.LayerNorm: its valid rows compared)
    or ``zeroed`` (MaskedLayerNorm: its padding must be 0, and a non-zero one fails)."""
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    dump(dumps, 0, MODULES[0], grads=False, padding="normalized")
    dump(dumps, 1, MODULES[1], grads=False, padding="zeroed")  # yet not zeroed: wrong
    dump(dumps, 2, MODULES[2], grads=False, plain=False, padding="zeroed")
    result, lines = json_lines(dumps)
    assert result.exit_code == 1
    verdicts = [(line["padding"], line["plain_layer_norm"], line["passed"]) for line in lines]
    assert verdicts == [
        ("normalized", True, True),
        ("zeroed", False, False),
        ("zeroed", False, True),
    ]
