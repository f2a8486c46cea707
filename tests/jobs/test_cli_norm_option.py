"""`--norm layer|rms`: which norm a file command computes, where it comes from, RMSNorm files.

RMSNorm's values are checked against a float64 reference of plain ops written here
(``y = x / sqrt(mean(x**2) + eps) * (offset + scale)``), independent of the op.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.clitools import assert_one_line_error, invoke, metadata, read, write


def rms_reference(x, valid, scale, eps, offset=0.0):
    """Float64 RMSNorm of the valid rows, +0.0 elsewhere, by plain ops."""
    x64 = torch.where(valid[..., None], x.double(), 0.0)
    rstd = 1 / torch.sqrt(x64.square().mean(-1, keepdim=True) + eps)
    y = x64 * rstd * (offset + scale.double())
    return torch.where(valid[..., None], y, 0.0)


def rms_inputs(shape=(3, 5, 8), dtype=torch.float32, seed=0, **extra):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=generator) * 3 + 0.5).to(dtype)
    valid = torch.rand(shape[:-1], generator=generator) > 0.3
    x[~valid] = math.nan  # padding never reaches a value
    scale = torch.randn(shape[-1], generator=generator).to(dtype)
    return {"x": x, "valid": valid, "scale": scale, **extra}


def normalized(tmp_path, tensors, *args, **meta):
    """``maskln normalize`` of ``tensors`` (written with metadata ``meta``) with ``args``,
    succeeding: its result and the path it wrote."""
    source = write(tmp_path / "in.safetensors", tensors, **meta)
    out_path = tmp_path / "out.safetensors"
    result = invoke("normalize", source, out_path, *args)
    assert result.exit_code == 0, result.stderr
    return result, out_path


def assert_rms_out(path, tensors, eps, offset=0.0, tolerance=1e-12, scale=None):
    """The ``out`` written at ``path`` is the float64 reference's RMSNorm of ``tensors``."""
    scale = tensors["scale"] if scale is None else scale
    expected = rms_reference(tensors["x"], tensors["valid"], scale, eps, offset=offset)
    out = read(path)["out"]
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
    return out


def test_rms_output_matches_a_float64_reference_and_zeroes_padding(tmp_path):
    tensors = rms_inputs()
    result, out_path = normalized(tmp_path, tensors, "--norm", "rms")
    out = assert_rms_out(out_path, tensors, 1e-6, tolerance=2e-6)
    padded = out[~tensors["valid"]]
    assert torch.equal(padded, torch.zeros_like(padded))
    assert not torch.signbit(padded).any()
    written = metadata(out_path)
    assert (written["norm"], float(written["eps"])) == ("rms", 1e-6)  # RMSNorm's default eps
    assert "wrote" in result.stderr and "RMSNorm out [3, 5, 8]" in result.stderr


def test_rms_gradients_have_no_grad_bias_and_match_float64_autograd(tmp_path):
    generator = torch.Generator().manual_seed(1)
    tensors = rms_inputs(dtype=torch.float64, seed=1)
    tensors["grad_out"] = torch.randn(tensors["x"].shape, generator=generator, dtype=torch.float64)
    source = write(tmp_path / "in.safetensors", tensors)
    out_path = tmp_path / "out.safetensors"
    result = invoke("normalize", source, out_path, "--norm", "rms", "--eps", "0.01")
    assert result.exit_code == 0, result.stderr
    written = read(out_path)
    assert sorted(written) == ["grad_scale", "grad_x", "out"]
    x = torch.where(tensors["valid"][..., None], tensors["x"], 0.0).requires_grad_()
    scale = tensors["scale"].clone().requires_grad_()
    y = rms_reference(x, tensors["valid"], scale, 0.01)
    grad_x, grad_scale = torch.autograd.grad(y, (x, scale), tensors["grad_out"])
    torch.testing.assert_close(written["grad_x"], grad_x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(written["grad_scale"], grad_scale, rtol=1e-12, atol=1e-12)


def test_offset_gives_gemmas_one_plus_scale(tmp_path):
    tensors = rms_inputs(dtype=torch.float64, seed=2)
    _, out_path = normalized(tmp_path, tensors, "--norm", "rms", "--gain-offset", "1")
    assert_rms_out(out_path, tensors, 1e-6, offset=1.0)
    assert float(metadata(out_path)["offset"]) == 1.0


def test_offset_for_layer_norm_is_an_error(tmp_path):
    source = write(tmp_path / "in.safetensors", rms_inputs())
    result = invoke("normalize", source, tmp_path / "out.safetensors", "--gain-offset", "1")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "--gain-offset", "rms")


def write_config(folder, **entries):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **entries}))
    return folder


def test_a_config_with_rms_norm_eps_gives_the_norm_and_its_eps(tmp_path):
    tensors = rms_inputs(dtype=torch.float64, seed=3)
    model = write_config(tmp_path / "model", rms_norm_eps=0.25)
    _, out_path = normalized(tmp_path, tensors, "--config", model)
    assert_rms_out(out_path, tensors, 0.25)
    written = metadata(out_path)
    assert written["norm"] == "rms"
    assert written["eps_source"].endswith("config.json: rms_norm_eps")


def test_norm_layer_against_an_rms_config_is_a_one_line_error(tmp_path):
    source = write(tmp_path / "in.safetensors", rms_inputs())
    model = write_config(tmp_path / "model", rms_norm_eps=1e-6)
    result = invoke(
        "normalize", source, tmp_path / "out.safetensors", "--config", model, "--norm", "layer"
    )
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "config.json", "rms_norm_eps", "--norm rms")
    assert not (tmp_path / "out.safetensors").exists()


def test_norm_rms_against_a_layer_config_is_a_one_line_error(tmp_path):
    source = write(tmp_path / "in.safetensors", rms_inputs())
    model = write_config(tmp_path / "model", layer_norm_eps=1e-12)
    result = invoke(
        "normalize", source, tmp_path / "out.safetensors", "--config", model, "--norm", "rms"
    )
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "config.json", "layer_norm_eps", "--norm layer")


def test_the_input_metadata_names_the_norm_and_its_eps(tmp_path):
    tensors = rms_inputs(dtype=torch.float64, seed=4)
    _, out_path = normalized(tmp_path, tensors, norm="rms", rms_norm_eps="0.5")
    assert_rms_out(out_path, tensors, 0.5)


def test_norm_option_overrides_the_metadata_with_a_note(tmp_path):
    tensors = rms_inputs(dtype=torch.float64, seed=5)
    result, out_path = normalized(tmp_path, tensors, "--norm", "rms", norm="layer", eps="0.5")
    assert "--norm rms overrides" in result.stderr and "'layer'" in result.stderr
    assert_rms_out(out_path, tensors, 0.5)


@pytest.mark.parametrize(
    ("args", "meta", "fragments"),
    [
        (("--norm", "rms", "--bias-key", "b"), {}, ("--bias-key", "'b'", "RMSNorm has no bias")),
        ((), {"norm": "group"}, ("in.safetensors", "metadata 'norm'", "'group'", "layer, rms")),
        (("--norm", "batch"), {}, ("--norm", "batch")),
    ],
)
def test_bad_norm_input_is_one_line_and_exit_2(tmp_path, args, meta, fragments):
    tensors = rms_inputs(b=torch.zeros(8))
    source = write(tmp_path / "in.safetensors", tensors, **meta)
    result = invoke("normalize", source, tmp_path / "out.safetensors", *args)
    assert result.exit_code == 2
    if args[:2] == ("--norm", "batch"):  # refused by the option parser itself
        assert "batch" in result.stderr and "Traceback" not in result.stderr
    else:
        assert_one_line_error(result.stderr, *fragments)
    assert not (tmp_path / "out.safetensors").exists()


def test_a_module_with_a_bias_is_refused_for_rms(tmp_path):
    source = write(tmp_path / "in.safetensors", rms_inputs())
    params = write(
        tmp_path / "params.safetensors", {"ln.weight": torch.ones(8), "ln.bias": torch.zeros(8)}
    )
    result = invoke(
        "normalize", source, tmp_path / "o.safetensors", "--params", params,
        "--module", "ln", "--norm", "rms",
    )  # fmt: skip
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "'ln.bias'", "RMSNorm has no bias")


def test_an_rms_module_without_bias_reads_its_weight(tmp_path):
    tensors = rms_inputs(dtype=torch.float64, seed=6)
    weight = tensors.pop("scale")
    source = write(tmp_path / "in.safetensors", tensors)
    params = write(tmp_path / "params.safetensors", {"model.norm.weight": weight})
    out_path = tmp_path / "out.safetensors"
    result = invoke(
        "normalize", source, out_path, "--params", params, "--module", "model.norm",
        "--norm", "rms",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "no bias" not in result.stderr  # RMSNorm has none: nothing to say
    assert_rms_out(out_path, tensors, 1e-6, scale=weight)


def test_a_default_bias_tensor_is_not_used_by_rms_and_said(tmp_path):
    tensors = rms_inputs(dtype=torch.float64, seed=7, bias=torch.full((8,), 100.0))
    result, out_path = normalized(tmp_path, tensors, "--norm", "rms")
    assert "'bias'" in result.stderr and "RMSNorm has no bias" in result.stderr
    assert_rms_out(out_path, tensors, 1e-6)


def test_layer_norm_stays_the_default_and_says_so_in_metadata(tmp_path):
    tensors = rms_inputs(dtype=torch.float64, seed=8)
    source = write(tmp_path / "in.safetensors", tensors)
    out_path = tmp_path / "out.safetensors"
    result = invoke("normalize", source, out_path)
    assert result.exit_code == 0, result.stderr
    x = torch.where(tensors["valid"][..., None], tensors["x"], 0.0)
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).square().mean(-1, keepdim=True)
    expected = (x - mean) / torch.sqrt(var + 1e-5) * tensors["scale"]
    expected = torch.where(tensors["valid"][..., None], expected, 0.0)
    torch.testing.assert_close(read(out_path)["out"], expected, rtol=1e-12, atol=1e-12)
    assert metadata(out_path)["norm"] == "layer"


def test_verify_judges_an_rms_problem_by_its_metadata_or_norm_option(tmp_path):
    tensors = rms_inputs(dtype=torch.float64, seed=9)
    plain = write(tmp_path / "plain.safetensors", tensors)
    named = write(tmp_path / "in.safetensors", tensors, norm="rms")
    expected = rms_reference(tensors["x"], tensors["valid"], tensors["scale"], 1e-6)
    result_file = write(tmp_path / "kernel.safetensors", {"out": expected})
    for args in ((named,), (plain, "--norm", "rms")):
        result = invoke("verify", *args[:1], result_file, *args[1:])
        assert result.exit_code == 0, result.stdout + result.stderr
        assert "F.rms_norm in float64" in result.stdout
    # Judged as LayerNorm (the default without the metadata), the RMSNorm result is wrong.
    assert invoke("verify", plain, result_file).exit_code == 1


def test_verify_norm_layer_overrides_the_metadata_and_judges_layer_norm(tmp_path):
    tensors = rms_inputs(dtype=torch.float64, seed=10)
    source = write(tmp_path / "in.safetensors", tensors, norm="rms")
    x = torch.where(tensors["valid"][..., None], tensors["x"], 0.0)
    mean = x.mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt((x - mean).square().mean(-1, keepdim=True) + 1e-5)
    y = torch.where(tensors["valid"][..., None], y * tensors["scale"], 0.0)
    result_file = write(tmp_path / "kernel.safetensors", {"out": y})
    result = invoke("verify", source, result_file, "--norm", "layer")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "--norm layer overrides" in result.stdout + result.stderr


# --- generate, diff ----------------------------------------------------------------------------


def test_generate_rms_writes_no_bias_and_names_the_norm_and_its_default_eps(tmp_path):
    path = tmp_path / "g.safetensors"
    result = invoke("generate", path, "--shape", "2,6,8", "--norm", "rms", "--grad")
    assert result.exit_code == 0, result.stderr
    tensors = read(path)
    assert sorted(tensors) == ["grad_out", "scale", "valid", "x"]
    written = metadata(path)
    assert (written["norm"], float(written["eps"])) == ("rms", 1e-6)
    layer = tmp_path / "layer.safetensors"
    assert invoke("generate", layer, "--shape", "2,6,8", "--grad").exit_code == 0
    same = read(layer)
    assert all(torch.equal(tensors[k], same[k]) for k in tensors)  # only the bias is left out
    assert "bias" in same and "norm" not in metadata(layer)  # layer: every reader's default
    # generate -> normalize: the file says which norm, and normalize computes it.
    out = tmp_path / "out.safetensors"
    assert invoke("normalize", path, out).exit_code == 0
    valid = tensors["valid"]
    expected = rms_reference(tensors["x"], valid, tensors["scale"], 1e-6)
    torch.testing.assert_close(read(out)["out"].double(), expected, rtol=2e-6, atol=2e-6)
    assert sorted(read(out)) == ["grad_scale", "grad_x", "out"]


def test_generate_gain_offset_is_written_for_rms_and_refused_for_layer(tmp_path):
    path = tmp_path / "g.safetensors"
    args = ("--shape", "2,3,4", "--norm", "rms", "--gain-offset", "1")
    assert invoke("generate", path, *args).exit_code == 0
    assert float(metadata(path)["offset"]) == 1.0
    tensors = read(path)
    out = tmp_path / "out.safetensors"
    assert invoke("normalize", path, out).exit_code == 0
    expected = rms_reference(tensors["x"], tensors["valid"], tensors["scale"], 1e-6, offset=1.0)
    torch.testing.assert_close(read(out)["out"].double(), expected, rtol=2e-6, atol=2e-6)
    refused = invoke("generate", path, "--shape", "2,3,4", "--gain-offset", "1")
    assert refused.exit_code == 2
    assert_one_line_error(refused.stderr, "--gain-offset", "rms")


def test_diff_says_when_the_two_files_are_of_different_norms(tmp_path):
    tensors = {"out": torch.ones(2, 3)}
    rms = write(tmp_path / "rms.safetensors", tensors, norm="rms")
    layer = write(tmp_path / "layer.safetensors", tensors, norm="layer")
    document = json.loads(invoke("diff", rms, layer, "--json").stdout)
    assert document["passed"] is True  # the values are equal: the note says what differs
    assert any("RMSNorm" in n and "LayerNorm" in n for n in document["notes"]), document
    same = json.loads(invoke("diff", rms, rms, "--json").stdout)
    assert not any("norm" in n for n in same["notes"])


def test_diff_norm_refuses_a_file_of_another_norm(tmp_path):
    tensors = {"out": torch.ones(2, 3)}
    rms = write(tmp_path / "rms.safetensors", tensors, norm="rms")
    layer = write(tmp_path / "layer.safetensors", tensors, norm="layer")
    result = invoke("diff", rms, layer, "--norm", "rms")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "layer.safetensors", "metadata 'norm'", "'layer'")
    assert invoke("diff", rms, rms, "--norm", "rms").exit_code == 0


# --- inspect -------------------------------------------------------------------------------------


def test_inspect_says_a_checkpoints_norm_and_eps_from_its_config(tmp_path):
    model = write_config(tmp_path / "model", rms_norm_eps=3e-6)
    write(model / "model.safetensors", {"model.norm.weight": torch.ones(8)})
    document = json.loads(invoke("inspect", model, "--json").stdout)
    assert document["norm"] == {
        "name": "rms",
        "eps": 3e-6,
        "source": f"{model / 'config.json'}: rms_norm_eps",
    }
    human = invoke("inspect", model)
    assert human.exit_code == 0
    assert "RMSNorm, eps 3e-06" in human.stdout
    wrong = invoke("inspect", model, "--norm", "layer")
    assert wrong.exit_code == 2
    assert_one_line_error(wrong.stderr, "config.json", "rms_norm_eps", "--norm rms")


def test_inspect_says_the_norm_a_files_metadata_names_and_none_otherwise(tmp_path):
    rms = write(tmp_path / "rms.safetensors", {"x": torch.ones(2, 3)}, norm="rms", eps="0.5")
    document = json.loads(invoke("inspect", rms, "--json").stdout)
    assert document["norm"] == {"name": "rms", "eps": 0.5, "source": "metadata 'norm'"}
    plain = write(tmp_path / "plain.safetensors", {"x": torch.ones(2, 3)})
    assert json.loads(invoke("inspect", plain, "--json").stdout)["norm"] is None
    chosen = json.loads(invoke("inspect", plain, "--json", "--norm", "rms").stdout)
    assert chosen["norm"] == {"name": "rms", "eps": None, "source": "--norm"}
    bad = write(tmp_path / "bad.safetensors", {"x": torch.ones(2, 3)}, norm="batch")
    result = invoke("inspect", bad)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "bad.safetensors", "metadata 'norm'", "'batch'")


# --- dtypes, chunks, hostile values --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rms_in_each_dtype_is_within_its_rounding_of_float64(tmp_path, dtype):
    tensors = rms_inputs(shape=(4, 6, 64), dtype=dtype, seed=11)
    generator = torch.Generator().manual_seed(12)
    tensors["grad_out"] = torch.randn(tensors["x"].shape, generator=generator).to(dtype)
    source = write(tmp_path / "in.safetensors", tensors)
    out_path = tmp_path / "out.safetensors"
    result = invoke("normalize", source, out_path, "--norm", "rms")
    assert result.exit_code == 0, result.stderr
    written = read(out_path)
    assert {t.dtype for t in written.values()} == {dtype}
    valid = tensors["valid"]
    x = torch.where(valid[..., None], tensors["x"].double(), 0.0).requires_grad_()
    scale = tensors["scale"].double().requires_grad_()
    y = rms_reference(x, valid, scale, 1e-6)
    grad_x, grad_scale = torch.autograd.grad(y, (x, scale), tensors["grad_out"].double())
    # computed in float32, rounded once to the dtype: within a few of its ulps
    tolerance = {"rtol": 4 * torch.finfo(dtype).eps, "atol": 4 * torch.finfo(dtype).eps}
    torch.testing.assert_close(written["out"].double(), y.detach(), **tolerance)
    torch.testing.assert_close(written["grad_x"].double(), grad_x, **tolerance)
    scale_tolerance = {k: v * 8 for k, v in tolerance.items()}  # a sum over 24 rows
    torch.testing.assert_close(written["grad_scale"].double(), grad_scale, **scale_tolerance)


def test_rms_chunked_results_equal_one_whole_call(tmp_path):
    tensors = rms_inputs(shape=(5, 7, 16), seed=13)
    tensors["grad_out"] = torch.randn(
        tensors["x"].shape, generator=torch.Generator().manual_seed(1)
    )
    source = write(tmp_path / "in.safetensors", tensors)
    outputs = {}
    for rows in ("1", "3", "1000"):
        path = tmp_path / f"out{rows}.safetensors"
        result = invoke("normalize", source, path, "--norm", "rms", "--chunk-rows", rows)
        assert result.exit_code == 0, result.stderr
        outputs[rows] = read(path)
    for rows in ("1", "3"):
        for key in ("out", "grad_x"):  # bit for bit, as one whole call
            assert torch.equal(outputs[rows][key], outputs["1000"][key]), (rows, key)
        torch.testing.assert_close(outputs[rows]["grad_scale"], outputs["1000"]["grad_scale"])


@pytest.mark.parametrize(
    ("args", "meta", "fragments"),
    [
        (("--norm", "rms", "--gain-offset", "nan"), {}, ("--gain-offset", "finite")),
        (("--norm", "rms", "--gain-offset", "inf"), {}, ("--gain-offset", "finite")),
        ((), {"norm": "rms", "offset": "one"}, ("metadata 'offset'", "'one'", "not a number")),
        ((), {"norm": "rms", "rms_norm_eps": "tiny"}, ("metadata 'rms_norm_eps'", "not a number")),
        (("--norm", "rms", "--eps", "0"), {}, ("--eps", "finite positive")),
    ],
)
def test_bad_rms_values_are_one_line_and_exit_2(tmp_path, args, meta, fragments):
    source = write(tmp_path / "in.safetensors", rms_inputs(), **meta)
    result = invoke("normalize", source, tmp_path / "out.safetensors", *args)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, *fragments)
    assert not (tmp_path / "out.safetensors").exists()


def test_params_from_an_rms_model_without_config_says_which_config_gives_the_norm(tmp_path):
    model = write_config(tmp_path / "llama", rms_norm_eps=1e-5)
    write(model / "model.safetensors", {"model.norm.weight": torch.ones(8)})
    source = write(tmp_path / "in.safetensors", rms_inputs())
    result = invoke(
        "normalize", source, tmp_path / "o.safetensors", "--params", model, "--module", "model.norm"
    )
    assert result.exit_code == 0, result.stderr
    config = model / "config.json"
    assert f"{config} gives rms_norm_eps 1e-05 (RMSNorm): --config {config} reads" in result.stderr
