"""Real checkpoints (issue 12, items 1-3): eps from config.json, finding keys, --module, shards.

Checkpoints here are written by hand, as ``save_pretrained`` lays them out (config.json,
model.safetensors or model.safetensors.index.json with shards); test_transformers_checkpoints.py
does the same with real transformers models. Values are checked against the float64 reference.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import Result

from maskln_cli.files.keynames import closest_keys, missing_key_message
from maskln_cli.op.reference import reference_masked_layer_norm
from tests.clitools import assert_one_line_error, invoke, metadata, read, write

CHANNELS = 8
LAYERS = 6


def activations(seed=0, spread=1e-3, dtype=torch.float64):
    """x with a small spread (variance 1e-6), so that eps 1e-12 and 1e-5 give different results."""
    generator = torch.Generator().manual_seed(seed)
    x = (spread * torch.randn(3, 5, CHANNELS, generator=generator, dtype=torch.float64)).to(dtype)
    valid = torch.rand(3, 5, generator=generator) > 0.3
    x[~valid] = math.nan
    return {"x": x, "valid": valid}


def parameters(seed=1, gamma=False, layers=LAYERS):
    """A checkpoint's tensors: per layer a layer norm and a dense layer, as BERT names them."""
    generator = torch.Generator().manual_seed(seed)
    scale_name, bias_name = ("gamma", "beta") if gamma else ("weight", "bias")
    tensors = {}
    for layer in range(layers):
        prefix = f"encoder.layer.{layer}."
        norm = torch.randn(CHANNELS, generator=generator, dtype=torch.float64)
        tensors[f"{prefix}LayerNorm.{scale_name}"] = 1.0 + 0.1 * norm
        tensors[f"{prefix}LayerNorm.{bias_name}"] = 0.1 * torch.randn(
            CHANNELS, generator=generator, dtype=torch.float64
        )
        tensors[f"{prefix}dense.weight"] = torch.randn(
            CHANNELS, CHANNELS, generator=generator, dtype=torch.float64
        )
        tensors[f"{prefix}dense.bias"] = torch.randn(
            CHANNELS, generator=generator, dtype=torch.float64
        )
    return tensors


def write_config(folder, **fields):
    folder.mkdir(exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({"model_type": "bert", "hidden_size": CHANNELS, **fields}))
    return path


def write_sharded(folder, tensors, shards=3):
    """save_pretrained's sharded layout: model-0000i-of-0000n.safetensors and the index."""
    folder.mkdir(exist_ok=True)
    names = list(tensors)
    weight_map = {}
    for index in range(shards):
        shard = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[index::shards]}
        write(folder / shard, part, format="pt")
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": 123}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


def reference(acts, params, module, eps, gamma=False):
    scale, bias = ("gamma", "beta") if gamma else ("weight", "bias")
    return reference_masked_layer_norm(
        acts["x"], acts["valid"], params[f"{module}.{scale}"], params[f"{module}.{bias}"], eps
    )


def assert_close_to(out, expected):
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


MODULE = "encoder.layer.2.LayerNorm"


# --- 1. eps -------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["layer_norm_eps", "layer_norm_epsilon", "norm_eps"])
def test_config_gives_eps(tmp_path, key):
    acts, params = activations(), parameters()
    source = write(tmp_path / "acts.safetensors", acts)
    checkpoint = write(tmp_path / "model.safetensors", params)
    config = write_config(tmp_path / "model", **{key: 1e-12})
    output = tmp_path / "out.safetensors"
    result = invoke(
        "normalize", source, output, "--params", checkpoint, "--module", MODULE, "--config", config
    )
    assert result.exit_code == 0, result.stderr
    assert_close_to(read(output)["out"], reference(acts, params, MODULE, 1e-12))
    # The test discriminates: the default eps gives a clearly different result here.
    assert not torch.allclose(
        read(output)["out"], reference(acts, params, MODULE, 1e-5), rtol=1e-6, atol=0
    )
    assert metadata(output)["eps"] == "1e-12"
    assert metadata(output)["eps_source"] == f"{config}: {key}"
    assert f"eps 1e-12 ({config}: {key})" in result.stderr


def test_config_folder_means_its_config_json(tmp_path):
    acts = activations()
    source = write(tmp_path / "acts.safetensors", acts)
    config = write_config(tmp_path / "model", layer_norm_eps=1e-7)
    output = tmp_path / "out.safetensors"
    assert invoke("normalize", source, output, "--config", tmp_path / "model").exit_code == 0
    assert metadata(output)["eps_source"] == f"{config}: layer_norm_eps"


@pytest.mark.parametrize(
    ("args", "file_metadata", "eps", "source"),
    [
        (("--eps", "0.5", "--config", "CONFIG"), {"eps": "0.25"}, 0.5, "--eps"),
        (("--config", "CONFIG"), {"eps": "0.25"}, 1e-12, "CONFIG: layer_norm_eps"),
        ((), {"eps": "0.25", "layer_norm_eps": "0.125"}, 0.25, "metadata 'eps'"),
        ((), {"layer_norm_eps": "0.125"}, 0.125, "metadata 'layer_norm_eps'"),
        ((), {}, 1e-5, "default"),
    ],
)
def test_eps_precedence(tmp_path, args, file_metadata, eps, source):
    acts = activations(spread=1.0)
    source_file = write(tmp_path / "acts.safetensors", acts, **file_metadata)
    config = write_config(tmp_path / "model", layer_norm_eps=1e-12)
    args = tuple(str(config) if a == "CONFIG" else a for a in args)
    output = tmp_path / "out.safetensors"
    result = invoke("normalize", source_file, output, *args)
    assert result.exit_code == 0, result.stderr
    ones, zeros = torch.ones(CHANNELS), torch.zeros(CHANNELS)
    expected = reference_masked_layer_norm(acts["x"], acts["valid"], ones, zeros, eps)
    assert_close_to(read(output)["out"], expected)
    assert metadata(output)["eps"] == repr(eps)
    assert metadata(output)["eps_source"] == source.replace("CONFIG", str(config))
    assert ("using the default 1e-05" in result.stderr) == (source == "default")


def test_default_eps_note_points_at_the_checkpoints_config(tmp_path):
    source = write(tmp_path / "acts.safetensors", activations())
    folder = write_sharded(tmp_path / "model", parameters())
    write_config(folder, layer_norm_eps=1e-12)
    result = invoke(
        "normalize", source, tmp_path / "o.safetensors", "--params", folder, "--module", MODULE
    )
    assert result.exit_code == 0, result.stderr
    hint = f"{folder / 'config.json'} gives layer_norm_eps 1e-12: --config {folder / 'config.json'}"
    assert hint in result.stderr


@pytest.mark.parametrize("fields", [{}])  # an rms_norm_eps is named: test_cli_norm_option.py
def test_default_eps_note_is_silent_about_a_config_without_a_layer_norm_eps(tmp_path, fields):
    source = write(tmp_path / "acts.safetensors", activations())
    folder = write_sharded(tmp_path / "model", parameters())
    write_config(folder, **fields)
    result = invoke(
        "normalize", source, tmp_path / "o.safetensors", "--params", folder, "--module", MODULE
    )
    assert result.exit_code == 0, result.stderr
    assert "using the default 1e-05" in result.stderr
    assert "--config" not in result.stderr.split("using the default 1e-05")[1]


def test_eps_option_overriding_the_config_is_said(tmp_path):
    source = write(tmp_path / "acts.safetensors", activations())
    config = write_config(tmp_path / "model", layer_norm_eps=1e-12)
    result = invoke(
        "normalize", source, tmp_path / "o.safetensors", "--config", config, "--eps", "1e-6"
    )
    assert result.exit_code == 0
    assert f"--eps 1e-06 overrides {config}: layer_norm_eps 1e-12" in result.stderr


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ('{"hidden_size": 8', ("not valid JSON", "line 1")),
        ("[1e-12]", ("not a model config",)),
        ('{"layer_norm_eps": "1e-12"}', ("'layer_norm_eps'", "not a number")),
        ('{"layer_norm_eps": true}', ("'layer_norm_eps'", "not a number")),
        ('{"layer_norm_eps": -1}', ("layer_norm_eps", "finite positive")),
        ('{"layer_norm_eps": 1e-60}', ("layer_norm_eps", "rounds to 0")),
        ('{"hidden_size": 8}', ("none of 'layer_norm_eps', 'layer_norm_epsilon', 'norm_eps'",)),
        (
            '{"text_config": {"layer_norm_eps": 1e-5}, "vision_config": {"layer_norm_eps": 1e-6}}',
            ("only inside 'text_config', 'vision_config'", "--eps"),
        ),
        (b'{"layer_norm_eps": "\xff"}', ("not valid JSON", "UTF-8")),
    ],
)
def test_bad_config_is_one_line_naming_the_file(tmp_path, text, fragments):
    source = write(tmp_path / "acts.safetensors", activations(dtype=torch.float32))
    config = tmp_path / "config.json"
    config.write_bytes(text if isinstance(text, bytes) else text.encode())
    output = tmp_path / "o.safetensors"
    result = invoke("normalize", source, output, "--config", config)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, str(config), *fragments)
    assert not output.exists()


def test_missing_config(tmp_path):
    source = write(tmp_path / "acts.safetensors", activations())
    for config, fragment in ((tmp_path / "nope.json", "no such file"), (tmp_path, "no such file")):
        result = invoke("normalize", source, tmp_path / "o.safetensors", "--config", config)
        assert result.exit_code == 2
        assert_one_line_error(result.stderr, "config", fragment)


def test_verify_shows_eps_and_its_source(tmp_path):
    acts = activations()
    source = write(tmp_path / "acts.safetensors", acts)
    config = write_config(tmp_path / "model", layer_norm_eps=1e-12)
    ones, zeros = torch.ones(CHANNELS), torch.zeros(CHANNELS)
    expected = reference_masked_layer_norm(acts["x"], acts["valid"], ones, zeros, 1e-12)
    kernel = write(tmp_path / "kernel.safetensors", {"out": expected})
    document = json.loads(invoke("verify", source, kernel, "--config", config, "--json").stdout)
    assert document["passed"] is True
    assert (document["eps"], document["eps_source"]) == (1e-12, f"{config}: layer_norm_eps")
    human = invoke("verify", source, kernel, "--config", config)
    assert human.exit_code == 0
    assert f"eps        1e-12, from {config}: layer_norm_eps" in human.stdout
    # Without the config, the default applies, the check fails, and the report says why.
    default = invoke("verify", source, kernel)
    assert default.exit_code == 1
    assert "eps        1e-05, the default" in default.stdout
    assert "using the default 1e-05" in default.stdout
    as_json = json.loads(invoke("verify", source, kernel, "--json").stdout)
    assert (as_json["eps"], as_json["eps_source"]) == (1e-5, "default")


# --- 2. finding keys ----------------------------------------------------------------------------


def test_closest_keys_swap_weight_and_gamma_and_ignore_case():
    keys = list(parameters(gamma=True))
    weight = closest_keys("encoder.layer.3.layernorm.weight", keys)
    assert weight[0] == "encoder.layer.3.LayerNorm.gamma"  # same module first
    assert len(weight) == 5 and all(k.endswith("LayerNorm.gamma") for k in weight)
    bias = closest_keys("encoder.layer.3.LayerNorm.bias", keys)
    assert bias[0] == "encoder.layer.3.LayerNorm.beta"
    assert closest_keys("ENCODER.LAYER.0.DENSE.WEIGHT", keys)[0] == "encoder.layer.0.dense.weight"
    assert closest_keys("something else entirely", keys) == []


def test_missing_key_in_a_big_file_names_the_closest_not_the_first_alphabetically():
    keys = list(parameters(gamma=True))
    message = missing_key_message("model.safetensors", "encoder.layer.4.LayerNorm.weight", keys)
    assert "closest: 'encoder.layer.4.LayerNorm.gamma'" in message
    assert "encoder.layer.0.dense.bias" not in message  # the first key: not a suggestion
    assert f"lists all {len(keys)}" in message


def test_named_scale_key_missing_suggests_gamma_and_never_says_holds_neither(tmp_path):
    source = write(tmp_path / "acts.safetensors", activations())
    checkpoint = write(tmp_path / "model.safetensors", parameters(gamma=True))
    result = invoke(
        "normalize", source, tmp_path / "o.safetensors", "--params", checkpoint,
        "--scale-key", "encoder.layer.1.LayerNorm.weight",
        "--bias-key", "encoder.layer.1.LayerNorm.bias",
    )  # fmt: skip
    assert result.exit_code == 2
    assert_one_line_error(
        result.stderr,
        "no tensor 'encoder.layer.1.LayerNorm.weight'",
        "closest: 'encoder.layer.1.LayerNorm.gamma'",
    )
    assert "holds neither" not in result.stderr


def test_params_without_default_keys_point_at_module(tmp_path):
    source = write(tmp_path / "acts.safetensors", activations())
    checkpoint = write(tmp_path / "model.safetensors", parameters())
    result = invoke("normalize", source, tmp_path / "o.safetensors", "--params", checkpoint)
    assert result.exit_code == 2
    assert_one_line_error(
        result.stderr, "holds neither 'scale' nor 'bias'", "--module NAME",
        f"{LAYERS} such as 'encoder.layer.0.LayerNorm'",
    )  # fmt: skip


def normalize_with_module(
    tmp_path: Path, acts: dict[str, torch.Tensor], params: dict[str, torch.Tensor]
) -> tuple[Result, Path]:
    """``maskln normalize`` of ``acts`` with --params (a checkpoint of ``params``) --module MODULE
    --eps 1e-12, which must succeed; returns the result and the output's path."""
    source = write(tmp_path / "acts.safetensors", acts)
    checkpoint = write(tmp_path / "model.safetensors", params)
    output = tmp_path / "out.safetensors"
    result = invoke(
        "normalize", source, output, "--params", checkpoint, "--module", MODULE, "--eps", "1e-12"
    )
    assert result.exit_code == 0, result.stderr
    return result, output


@pytest.mark.parametrize("gamma", [False, True])
def test_module_takes_weight_and_bias_or_gamma_and_beta(tmp_path, gamma):
    acts, params = activations(), parameters(gamma=gamma)
    _, output = normalize_with_module(tmp_path, acts, params)
    assert_close_to(read(output)["out"], reference(acts, params, MODULE, 1e-12, gamma))


def test_module_from_the_input_itself(tmp_path):
    acts, params = activations(), parameters(layers=1)
    source = write(tmp_path / "acts.safetensors", {**acts, **params})
    output = tmp_path / "out.safetensors"
    module = "encoder.layer.0.LayerNorm"
    assert invoke("normalize", source, output, "--module", module, "--eps", "1e-12").exit_code == 0
    assert_close_to(read(output)["out"], reference(acts, params, module, 1e-12))


def test_module_without_bias_uses_zeros_with_a_note(tmp_path):
    acts, params = activations(), parameters()
    del params[f"{MODULE}.bias"]
    result, output = normalize_with_module(tmp_path, acts, params)
    assert f"module {MODULE!r} has no bias: using zeros" in result.stderr
    expected = reference_masked_layer_norm(
        acts["x"], acts["valid"], params[f"{MODULE}.weight"], torch.zeros(CHANNELS), 1e-12
    )
    assert_close_to(read(output)["out"], expected)


@pytest.mark.parametrize(
    ("module", "extra", "fragments"),
    [
        ("encoder.layer.2.layernorm", (), ("closest modules: 'encoder.layer.2.LayerNorm'",)),
        (f"{MODULE}.weight", (), (f"--module takes the module's name: {MODULE!r}",)),
        ("decoder.block", (), ("nor any module of a close name",)),
        (MODULE, ("--scale-key", "s"), ("--module and --scale-key",)),
        (MODULE, ("--bias-key", "b"), ("--module and --bias-key",)),
    ],
)
def test_module_errors(tmp_path, module, extra, fragments):
    source = write(tmp_path / "acts.safetensors", activations())
    checkpoint = write(tmp_path / "model.safetensors", parameters())
    output = tmp_path / "o.safetensors"
    result = invoke("normalize", source, output, "--params", checkpoint, "--module", module, *extra)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, *fragments)
    assert not output.exists()


def test_module_holding_both_weight_and_gamma_is_ambiguous(tmp_path):
    params = parameters()
    params[f"{MODULE}.gamma"] = params[f"{MODULE}.weight"].clone()
    source = write(tmp_path / "acts.safetensors", activations())
    checkpoint = write(tmp_path / "model.safetensors", params)
    result = invoke(
        "normalize", source, tmp_path / "o.safetensors", "--params", checkpoint, "--module", MODULE
    )
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, f"'{MODULE}.weight' and '{MODULE}.gamma'", "--scale-key")


def test_verify_with_module_and_config(tmp_path):
    acts, params = activations(), parameters(gamma=True)
    source = write(tmp_path / "acts.safetensors", acts)
    folder = tmp_path / "model"
    folder.mkdir()
    write(folder / "model.safetensors", params)
    write_config(folder, layer_norm_eps=1e-12)
    kernel = write(
        tmp_path / "kernel.safetensors", {"out": reference(acts, params, MODULE, 1e-12, True)}
    )
    result = invoke(
        "verify", source, kernel, "--params", folder, "--module", MODULE, "--config", folder
    )
    assert result.exit_code == 0, result.stdout + result.stderr


# --- 3. sharded checkpoints ---------------------------------------------------------------------


@pytest.mark.parametrize("form", ["folder", "index", "unsharded folder"])
def test_params_from_a_checkpoint_folder_or_index(tmp_path, form):
    acts, params = activations(), parameters()
    source = write(tmp_path / "acts.safetensors", acts)
    folder = tmp_path / "model"
    if form == "unsharded folder":
        folder.mkdir()
        write(folder / "model.safetensors", params)
        where = folder
    else:
        write_sharded(folder, params)
        where = folder if form == "folder" else folder / "model.safetensors.index.json"
    output = tmp_path / "out.safetensors"
    for module in ("encoder.layer.0.LayerNorm", "encoder.layer.4.LayerNorm"):
        result = invoke(
            "normalize", source, output, "--params", where, "--module", module, "--eps", "1e-12"
        )
        assert result.exit_code == 0, result.stderr
        assert_close_to(read(output)["out"], reference(acts, params, module, 1e-12))


def test_only_the_shards_needed_are_opened(tmp_path):
    acts, params = activations(), parameters()
    source = write(tmp_path / "acts.safetensors", acts)
    folder = write_sharded(tmp_path / "model", params, shards=3)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    needed = {index["weight_map"][f"{MODULE}.{s}"] for s in ("weight", "bias")}
    for shard in set(index["weight_map"].values()) - needed:
        (folder / shard).write_bytes(b"not a safetensors file")  # would fail if opened
    output = tmp_path / "out.safetensors"
    result = invoke("normalize", source, output, "--params", folder, "--module", MODULE)
    assert result.exit_code == 0, result.stderr
    assert len(needed) < 3


def test_index_naming_a_missing_shard(tmp_path):
    folder = write_sharded(tmp_path / "model", parameters())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][f"{MODULE}.weight"]
    (folder / shard).unlink()
    source = write(tmp_path / "acts.safetensors", activations())
    result = invoke(
        "normalize", source, tmp_path / "o.safetensors", "--params", folder, "--module", MODULE
    )
    assert result.exit_code == 2
    assert_one_line_error(
        result.stderr, "model.safetensors.index.json", f"shard {shard!r}", "no such file"
    )


def test_index_naming_a_key_its_shard_lacks(tmp_path):
    params = parameters()
    folder = write_sharded(tmp_path / "model", params)
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    key = f"{MODULE}.weight"
    other = next(
        s for s in sorted(set(index["weight_map"].values())) if s != index["weight_map"][key]
    )
    index["weight_map"][key] = other
    path.write_text(json.dumps(index))
    source = write(tmp_path / "acts.safetensors", activations())
    result = invoke(
        "normalize", source, tmp_path / "o.safetensors", "--params", folder, "--module", MODULE
    )
    assert result.exit_code == 2
    assert_one_line_error(
        result.stderr, "index.json", f"names shard {other!r}", repr(key), "holds no"
    )


@pytest.mark.parametrize(
    ("index", "fragments"),
    [
        ("{", ("not valid JSON",)),
        ('{"metadata": {}}', ("not a safetensors index", "weight_map")),
        ('{"weight_map": {"a": 3}}', ("not a safetensors index",)),
        ('{"weight_map": {"encoder.layer.2.LayerNorm.weight": "../x.safetensors"}}', ("refused",)),
        ('{"weight_map": {"encoder.layer.2.LayerNorm.weight": "/etc/passwd"}}', ("refused",)),
    ],
)
def test_bad_index(tmp_path, index, fragments):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(index)
    source = write(tmp_path / "acts.safetensors", activations())
    result = invoke(
        "normalize", source, tmp_path / "o.safetensors", "--params", folder, "--module", MODULE
    )
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "model.safetensors.index.json", *fragments)


def test_folder_without_a_checkpoint(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    write(folder / "weights.safetensors", parameters())
    source = write(tmp_path / "acts.safetensors", activations())
    result = invoke("normalize", source, tmp_path / "o.safetensors", "--params", folder)
    assert result.exit_code == 2
    assert_one_line_error(
        result.stderr, "neither model.safetensors nor model.safetensors.index.json",
        "weights.safetensors",
    )  # fmt: skip


def test_inspect_keys_of_a_sharded_checkpoint(tmp_path):
    params = parameters()
    folder = write_sharded(tmp_path / "model", params)
    document = json.loads(invoke("inspect", "--keys", "--json", folder).stdout)
    assert sorted(t["name"] for t in document["tensors"]) == sorted(params)
    shapes = {t["name"]: t["shape"] for t in document["tensors"]}
    assert shapes[f"{MODULE}.weight"] == [CHANNELS]
    assert document["metadata"] == {"total_size": "123"}


def test_inspect_of_a_sharded_checkpoint_is_that_of_one_file(tmp_path):
    # Small tensors are read many at a time (ShardedFile.stacked), from several shards at once.
    params = parameters()
    folder = write_sharded(tmp_path / "checkpoint", params)
    single = write(tmp_path / "one.safetensors", params)
    sharded = json.loads(invoke("inspect", "--json", folder).stdout)["tensors"]
    whole = json.loads(invoke("inspect", "--json", single).stdout)["tensors"]
    assert len(sharded) == len(params) == len(whole)
    assert {t["name"]: t for t in sharded} == {t["name"]: t for t in whole}
    first = next(t for t in whole if t["name"] == "encoder.layer.0.dense.bias")
    assert first["max"] == float(params["encoder.layer.0.dense.bias"].max())
