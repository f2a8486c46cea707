"""generate for numerics (issue 12, item 6): --offset, --std and --valid-dtype."""

from __future__ import annotations

import pytest
import torch

from maskln_cli.jobs import generate as generate_module
from maskln_cli.op.reference import reference_masked_layer_norm
from tests.clitools import assert_one_line_error, invoke, read


def generated(tmp_path, name, *args):
    output = tmp_path / name
    result = invoke("generate", output, "--shape", "3,40,24", "--seed", "4", "--grad", *args)
    assert result.exit_code == 0, result.stderr
    return read(output)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_offset_and_std_scale_the_same_draws(tmp_path, dtype):
    plain = generated(tmp_path, "plain.safetensors", "--dtype", dtype)
    shifted = generated(
        tmp_path, "shifted.safetensors", "--dtype", dtype, "--offset", "1e4", "--std", "0.1"
    )
    # x = offset + std * z from the same z, computed in float64 and rounded once.
    expected = (plain["x"].double() * 0.1 + 1e4).to(plain["x"].dtype)
    assert torch.equal(shifted["x"], expected)
    for key in ("valid", "scale", "bias", "grad_out"):  # the rest is untouched
        assert torch.equal(shifted[key], plain[key]), key
    valid_x = shifted["x"][shifted["valid"]].double()
    assert abs(valid_x.mean().item() - 1e4) < 0.01 and abs(valid_x.std().item() - 0.1) < 0.01


def test_offset_data_normalizes_like_the_float64_reference(tmp_path):
    """The point of --offset: float32 rows of 1e4 +- 0.1, where one-pass variances fail."""
    tensors = generated(tmp_path, "o.safetensors", "--offset", "1e4", "--std", "0.1")
    out = tmp_path / "out.safetensors"
    assert invoke("normalize", tmp_path / "o.safetensors", out).exit_code == 0
    expected = reference_masked_layer_norm(
        tensors["x"], tensors["valid"], tensors["scale"], tensors["bias"], 1e-5
    )
    error = (read(out)["out"].double() - expected).abs().max().item()
    assert error < 1e-4  # float32 with a corrected two-pass variance
    # The data does what it is for: torch's own float32 layer norm errs far more on it.
    x = tensors["x"]
    peer = torch.nn.functional.layer_norm(x, x.shape[-1:], tensors["scale"], tensors["bias"], 1e-5)
    peer_error = (peer.double() - expected)[tensors["valid"]].abs().max().item()
    assert peer_error > 100 * error


@pytest.mark.parametrize("valid_dtype", ["int64", "uint8"])
def test_valid_dtype(tmp_path, valid_dtype):
    as_bool = generated(tmp_path, "b.safetensors")
    as_numbers = generated(tmp_path, "n.safetensors", "--valid-dtype", valid_dtype)
    assert str(as_numbers["valid"].dtype) == f"torch.{valid_dtype}"
    assert torch.equal(as_numbers["valid"], as_bool["valid"].to(as_numbers["valid"].dtype))
    assert set(as_numbers["valid"].unique().tolist()) == {0, 1}
    for key in ("x", "scale", "bias", "grad_out"):
        assert torch.equal(as_numbers[key], as_bool[key]), key
    # normalize reads the integer mask as the bool one.
    outputs = {}
    for name in ("b", "n"):
        target = tmp_path / f"{name}_out.safetensors"
        assert invoke("normalize", tmp_path / f"{name}.safetensors", target).exit_code == 0
        outputs[name] = read(target)
    for key in ("out", "grad_x", "grad_scale", "grad_bias"):
        assert torch.equal(outputs["n"][key], outputs["b"][key]), key


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (
            ("--dtype", "float16", "--offset", "1e5"),
            ("--offset 100000 --std 1", "overflows float16"),
        ),
        (("--std", "-1"), ("--std", ">= 0")),
        (("--offset", "inf"), ("--offset", "finite")),
        (("--valid-dtype", "int8"), ("--valid-dtype",)),
    ],
)
def test_bad_numerics_options(tmp_path, args, fragments):
    output = tmp_path / "g.safetensors"
    result = invoke("generate", output, "--shape", "2,8,4", *args)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, *fragments)
    assert not output.exists()


def test_poisoned_padding_with_an_offset_is_not_an_overflow(tmp_path):
    output = tmp_path / "g.safetensors"
    result = invoke("generate", output, "--shape", "2,8,4", "--poison", "--offset", "100")
    assert result.exit_code == 0, result.stderr
    tensors = read(output)
    assert bool(tensors["x"][tensors["valid"]].isfinite().all())
    assert not bool(tensors["x"][~tensors["valid"]].isfinite().any())


@pytest.mark.parametrize("numel", [1, 15, 16, 17, 47, 48, 49, 63, 64, 65, 100, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sampling_in_chunks_draws_what_one_randn_call_does(monkeypatch, numel, dtype):
    """Progress comes from sampling in chunks; the numbers must not change for it."""
    monkeypatch.setattr(generate_module, "SAMPLE_CHUNK", 32)
    whole = torch.randn(numel, generator=torch.Generator().manual_seed(9), dtype=dtype)
    seen = []
    chunked = generate_module.sample_normal(
        (numel,), torch.Generator().manual_seed(9), dtype, advance=seen.append
    )
    assert torch.equal(chunked, whole)
    assert sum(seen) == numel
