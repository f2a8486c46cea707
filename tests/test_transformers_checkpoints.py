"""maskln on real transformers checkpoints (issue 12): the whole way a transformers user goes.

Tiny models are built from configs with random weights (nothing is downloaded), saved with
``save_pretrained`` unsharded and sharded, and run on a padded batch with an int64 attention
mask; hooks capture one LayerNorm's input, output and gradients under a loss over the valid
positions. ``maskln normalize`` and ``maskln verify`` then read the checkpoint folder with
``--config`` and ``--module``, and are compared with the model's own LayerNorm on valid rows
(values and gradients) and with the float64 reference.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch
import transformers

from maskln_cli.op.reference import reference_masked_layer_norm
from tests.clitools import invoke, metadata, read, write
from tests.model_runs import LENGTHS, run_padded_batch

COMMON = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}
# name: (config class, model class, config fields, the LayerNorm module, its eps key)
ARCHITECTURES = {
    "bert": ("BertConfig", "BertModel", {"vocab_size": 50}, "encoder.layer.1.output.LayerNorm"),
    "roberta": (
        "RobertaConfig",
        "RobertaModel",
        {"vocab_size": 50, "pad_token_id": 1},
        "encoder.layer.0.attention.output.LayerNorm",
    ),
    # ESM saves its LayerNorms as .gamma/.beta; its LayerNorm inputs have a small variance, so
    # eps 1e-12 and the default 1e-5 give clearly different results.
    "esm": (
        "EsmConfig",
        "EsmModel",
        {"vocab_size": 33, "pad_token_id": 1, "mask_token_id": 32},
        "encoder.layer.1.LayerNorm",
    ),
    # GPT-2's config says layer_norm_epsilon.
    "gpt2": (
        "GPT2Config",
        "GPT2Model",
        {"vocab_size": 50, "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64,
         "bos_token_id": 0, "eos_token_id": 0},
        "h.1.ln_2",
    ),
}  # fmt: skip


def build(name):
    config_class, model_class, fields, module_name = ARCHITECTURES[name]
    torch.manual_seed(0)
    common = {} if name == "gpt2" else COMMON
    config = getattr(transformers, config_class)(**common, **fields)
    return getattr(transformers, model_class)(config).eval(), module_name


def capture_layer_norm(model, module_name):
    """Run a padded batch; return the LayerNorm's input dump and its outputs and gradients."""
    module = model.get_submodule(module_name)
    assert isinstance(module, torch.nn.LayerNorm)
    acts, own = run_padded_batch(model, module)
    layer = {**own, "grad_scale": module.weight.grad, "grad_bias": module.bias.grad}
    return acts, layer, module


def float64_reference(acts, module):
    """Values and gradients of the formula in float64, valid rows only."""
    valid = acts["attention_mask"].bool()
    leaves = [t.detach().double().requires_grad_() for t in (acts["x"], module.weight, module.bias)]
    out = reference_masked_layer_norm(leaves[0], valid, leaves[1], leaves[2], module.eps)
    grads = torch.autograd.grad(out, leaves, acts["grad_out"].double())
    names = ("out", "grad_x", "grad_scale", "grad_bias")
    return dict(zip(names, (out.detach(), *grads), strict=True))


def save_and_capture(name, folder):
    """A model saved both ways, its LayerNorm's dumps, and the float64 reference."""
    model, module_name = build(name)
    model.save_pretrained(folder / "unsharded", safe_serialization=True)
    model.save_pretrained(folder / "sharded", safe_serialization=True, max_shard_size="20KB")
    acts, layer, module = capture_layer_norm(model, module_name)
    paths = {
        "acts": write(folder / "acts.safetensors", acts),
        "layer": write(folder / "layer.safetensors", layer),
    }
    return name, folder, module_name, module, acts, layer, float64_reference(acts, module), paths


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def saved(request, tmp_path_factory):
    return save_and_capture(request.param, tmp_path_factory.mktemp(request.param))


def test_checkpoints_are_what_save_pretrained_writes(saved):
    name, folder, module_name, *_ = saved
    assert (folder / "unsharded" / "model.safetensors").is_file()
    index = json.loads((folder / "sharded" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and not (folder / "sharded" / "model.safetensors").exists()
    held = [k for k in index["weight_map"] if k.startswith(module_name + ".")]
    suffixes = sorted(k.rsplit(".", 1)[1] for k in held)
    assert suffixes == (["beta", "gamma"] if name == "esm" else ["bias", "weight"])
    config = json.loads((folder / "unsharded" / "config.json").read_text())
    assert "layer_norm_epsilon" in config if name == "gpt2" else "layer_norm_eps" in config


def assert_float32_close(ours, float64):
    """float32 results against the float64 formula, at float32's default tolerance."""
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), float64, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("form", ["unsharded", "sharded"])
def test_normalize_matches_the_models_layer_norm_on_valid_rows(saved, tmp_path, form):
    name, folder, module_name, module, acts, layer, reference, paths = saved
    checkpoint = folder / form
    output = tmp_path / "out.safetensors"
    result = invoke(
        "normalize", paths["acts"], output, "--params", checkpoint,
        "--config", checkpoint / "config.json", "--module", module_name,
        "--valid-key", "attention_mask",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    key = "layer_norm_epsilon" if name == "gpt2" else "layer_norm_eps"
    assert metadata(output)["eps"] == repr(module.eps)
    assert metadata(output)["eps_source"] == f"{checkpoint / 'config.json'}: {key}"
    ours = read(output)
    valid = acts["attention_mask"].bool()
    for tensor in ("out", "grad_x"):
        # Against the float64 formula, and against the model's own LayerNorm, on valid rows.
        assert_float32_close(ours[tensor][valid], reference[tensor][valid])
        torch.testing.assert_close(ours[tensor][valid], layer[tensor][valid])
        assert bool((ours[tensor][~valid] == 0).all())  # padding: exactly 0
    for tensor in ("grad_scale", "grad_bias"):
        assert_float32_close(ours[tensor], reference[tensor])
        torch.testing.assert_close(ours[tensor], layer[tensor])
    # The model's own output is not 0 on padding: that is what --valid is for.
    assert bool((layer["out"][~valid] != 0).any())


@pytest.mark.parametrize("form", ["unsharded", "sharded"])
def test_verify_passes_on_valid_rows_with_the_configs_eps(saved, form):
    _, folder, module_name, module, _, _, _, paths = saved
    checkpoint = folder / form
    args = (
        "verify", paths["acts"], paths["layer"], "--params", checkpoint,
        "--module", module_name, "--valid-key", "attention_mask",
    )  # fmt: skip
    spec = f"{paths['acts']}:attention_mask"
    result = invoke(*args, "--config", checkpoint, "--valid", spec, "--json")
    assert result.exit_code == 0, result.stdout
    document = json.loads(result.stdout)
    assert document["eps"] == module.eps
    assert document["eps_source"].startswith(str(checkpoint / "config.json"))
    tensors = {t["name"]: t for t in document["tensors"]}
    assert set(tensors) == {"out", "grad_x", "grad_scale", "grad_bias"}
    padded = sum(max(LENGTHS) - n for n in LENGTHS)
    assert tensors["out"]["rows_left_out"] == tensors["grad_x"]["rows_left_out"] == padded
    # Every padded row differs (the model's output there is not 0): without --valid, a failure.
    without_valid = json.loads(invoke(*args, "--config", checkpoint, "--json").stdout)
    assert without_valid["passed"] is False
    out = next(t for t in without_valid["tensors"] if t["name"] == "out")
    assert out["invalid_rows_zero"] is False and out["mismatched_rows"] == padded


def test_esm_without_its_config_eps_fails_and_says_which_eps(tmp_path):
    """ESM's LayerNorm inputs have a small variance: eps 1e-12 and 1e-5 differ beyond tolerance."""
    _, folder, module_name, _, _, _, _, paths = save_and_capture("esm", tmp_path)
    spec = f"{paths['acts']}:attention_mask"
    result = invoke(
        "verify", paths["acts"], paths["layer"], "--params", folder / "sharded",
        "--module", module_name, "--valid-key", "attention_mask", "--valid", spec,
    )  # fmt: skip
    assert result.exit_code == 1
    assert "eps        1e-05, the default" in result.stdout
    config = folder / "sharded" / "config.json"
    assert f"{config} gives layer_norm_eps 1e-12: --config {config} reads it" in result.stdout
    # The kernel (the model) is right: the eps its rows give says the default may be ours.
    assert "RESULT's eps is at most" in result.stdout
    assert "not the reference's 1e-05 (the default): give the model's eps" in result.stdout
    explicit = invoke(
        "verify", paths["acts"], paths["layer"], "--params", folder / "sharded",
        "--module", module_name, "--valid-key", "attention_mask", "--valid", spec, "--eps", "1e-5",
    )  # fmt: skip
    assert explicit.exit_code == 1 and "RESULT's eps is at most" in explicit.stdout
    assert "give the model's eps" not in explicit.stdout  # eps was given: not ours to doubt
