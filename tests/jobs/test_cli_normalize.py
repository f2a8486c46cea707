"""`maskln normalize`: results, options, pipelines, batches, gradients, errors, atomic output."""

from __future__ import annotations

import errno
import math
import os
import pty
import stat
from pathlib import Path

import pytest
import safetensors.torch
import torch

from maskln_cli import __version__, masked_layer_normalization
from maskln_cli.errors import MasklnError
from maskln_cli.jobs import normalize as normalize_module
from maskln_cli.op.reference import reference_masked_layer_norm
from tests.clitools import (
    PAIRS,
    WORKED,
    assert_one_line_error,
    invoke,
    leftovers,
    metadata,
    read,
    run,
    write,
)


def random_inputs(shape=(3, 5, 8), dtype=torch.float32, seed=0, poison=True):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator).to(dtype)
    valid = torch.rand(shape[:-1], generator=generator) > 0.3
    if poison:
        x[~valid] = math.nan
    channels = shape[-1]
    return {
        "x": x,
        "valid": valid,
        "scale": torch.randn(channels, generator=generator).to(dtype),
        "bias": torch.randn(channels, generator=generator).to(dtype),
    }


def expected_out(tensors, eps=1e-5, dtype=None):
    dtype = dtype or tensors["x"].dtype
    return masked_layer_normalization(
        tensors["x"].to(dtype),
        tensors["valid"].bool(),
        tensors.get("scale", torch.ones(tensors["x"].shape[-1])).to(dtype),
        tensors.get("bias", torch.zeros(tensors["x"].shape[-1])).to(dtype),
        eps,
    )


# --- results ------------------------------------------------------------------------------------


def test_worked_example_file(tmp_path):
    result = invoke("normalize", WORKED, tmp_path / "out.safetensors")
    assert result.exit_code == 0, result.stderr
    out = read(tmp_path / "out.safetensors")
    assert list(out) == ["out"]
    assert torch.equal(out["out"], torch.tensor([[[-0.5, 0.5], [0.0, 0.0]]], dtype=torch.float64))
    assert metadata(tmp_path / "out.safetensors") == {
        "norm": "layer",
        "eps": "3.0",
        "eps_source": "metadata 'eps'",
        "dtype": "float64",
        "maskln_version": __version__,
    }
    assert "wrote" in result.stderr and "1 of 2 positions valid" in result.stderr


def test_output_equals_one_whole_library_call(tmp_path):
    tensors = random_inputs((4, 6, 16))
    source = write(tmp_path / "in.safetensors", tensors)
    assert invoke("normalize", source, tmp_path / "out.safetensors").exit_code == 0
    assert torch.equal(read(tmp_path / "out.safetensors")["out"], expected_out(tensors))


def test_sample_pair_features_match_float64_reference(tmp_path):
    assert invoke("normalize", PAIRS, tmp_path / "out.safetensors").exit_code == 0
    produced = read(tmp_path / "out.safetensors")
    expected = read(PAIRS.with_name("pair_features_expected.safetensors"))
    for key in ("out", "grad_x", "grad_scale", "grad_bias"):
        torch.testing.assert_close(produced[key], expected[key], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("chunk_rows", [1, 2, 3, 7, 50])
def test_chunked_results_are_identical_to_one_whole_call(tmp_path, chunk_rows):
    tensors = random_inputs((5, 11, 33), seed=chunk_rows)
    tensors["grad_out"] = torch.randn(tensors["x"].shape)
    source = write(tmp_path / "in.safetensors", tensors)
    whole, chunked = tmp_path / "whole.safetensors", tmp_path / "chunked.safetensors"
    assert invoke("normalize", source, whole, "--chunk-rows", 10**6).exit_code == 0
    assert invoke("normalize", source, chunked, "--chunk-rows", chunk_rows).exit_code == 0
    whole, chunked = read(whole), read(chunked)
    assert torch.equal(chunked["out"], whole["out"])
    assert torch.equal(chunked["out"], expected_out(tensors))
    assert torch.equal(chunked["grad_x"], whole["grad_x"])
    # grad_scale and grad_bias are sums over rows, accumulated over chunks in float64: not the
    # same bits as one float32 sum, but at least as close to the float64 truth.
    truth = autograd_gradients(
        {k: v.double() if v.is_floating_point() else v for k, v in tensors.items()}
    )
    for key in ("grad_scale", "grad_bias"):
        chunked_error = (chunked[key].double() - truth[key]).abs().max()
        whole_error = (whole[key].double() - truth[key]).abs().max()
        assert chunked_error <= max(whole_error, 1e-6 * truth[key].abs().max())


def test_progress_is_reported_up_to_the_total(tmp_path):
    tensors = random_inputs((40, 4))
    tensors["grad_out"] = torch.randn(40, 4)
    source = write(tmp_path / "in.safetensors", tensors)
    calls = []
    options = normalize_module.NormalizeOptions(chunk_rows=8)
    normalize_module.normalize_file(
        str(source), str(tmp_path / "o.safetensors"), options, lambda d, t: calls.append((d, t))
    )
    assert calls[-1] == (80, 80)  # two passes over 40 rows: forward, then gradients
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert len(calls) == 10


# --- options ------------------------------------------------------------------------------------


def test_custom_keys(tmp_path):
    tensors = random_inputs()
    renamed = {
        "acts": tensors["x"],
        "mask": tensors["valid"],
        "w": tensors["scale"],
        "b": tensors["bias"],
    }
    source = write(tmp_path / "in.safetensors", renamed)
    result = invoke(
        "normalize", source, tmp_path / "out.safetensors",
        "--x-key", "acts", "--valid-key", "mask", "--scale-key", "w", "--bias-key", "b",
        "--out-key", "normed",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert torch.equal(read(tmp_path / "out.safetensors")["normed"], expected_out(tensors))


def test_params_from_a_checkpoint(tmp_path):
    tensors = random_inputs()
    source = write(tmp_path / "in.safetensors", {"x": tensors["x"], "valid": tensors["valid"]})
    checkpoint = write(
        tmp_path / "model.safetensors",
        {
            "encoder.layers.0.norm.weight": tensors["scale"],
            "encoder.layers.0.norm.bias": tensors["bias"],
            "encoder.layers.0.linear.weight": torch.randn(8, 8),
        },
    )
    result = invoke(
        "normalize", source, tmp_path / "out.safetensors", "--params", checkpoint,
        "--scale-key", "encoder.layers.0.norm.weight",
        "--bias-key", "encoder.layers.0.norm.bias",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert torch.equal(read(tmp_path / "out.safetensors")["out"], expected_out(tensors))


def test_params_file_without_either_key_is_an_error(tmp_path):
    source = write(tmp_path / "in.safetensors", random_inputs())
    checkpoint = write(tmp_path / "model.safetensors", {"other": torch.ones(8)})
    result = invoke("normalize", source, tmp_path / "o.safetensors", "--params", checkpoint)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "model.safetensors", "'scale'", "'bias'")


@pytest.mark.parametrize(
    ("args", "file_eps", "used"),
    [
        ((), None, 1e-5),
        ((), "0.25", 0.25),
        (("--eps", "2.5"), "0.25", 2.5),
        (("--eps", "3"), None, 3.0),
    ],
)
def test_eps_from_option_then_metadata_then_default(tmp_path, args, file_eps, used):
    tensors = random_inputs()
    meta = {"eps": file_eps} if file_eps else {}
    source = write(tmp_path / "in.safetensors", tensors, **meta)
    assert invoke("normalize", source, tmp_path / "o.safetensors", *args).exit_code == 0
    assert metadata(tmp_path / "o.safetensors")["eps"] == repr(used)
    assert torch.equal(read(tmp_path / "o.safetensors")["out"], expected_out(tensors, used))


@pytest.mark.parametrize(
    ("stored", "option", "result_dtype"),
    [
        (torch.float32, "auto", torch.float32),
        (torch.float32, "float64", torch.float64),
        (torch.float64, "float32", torch.float32),
        (torch.float16, "auto", torch.float16),
        (torch.bfloat16, "float32", torch.float32),
    ],
)
def test_dtype_option_casts_every_tensor(tmp_path, stored, option, result_dtype):
    tensors = random_inputs(dtype=stored)
    tensors["scale"] = tensors["scale"].double()  # a parameter in another dtype is cast too
    source = write(tmp_path / "in.safetensors", tensors)
    result = invoke("normalize", source, tmp_path / "o.safetensors", "--dtype", option)
    assert result.exit_code == 0, result.stderr
    out = read(tmp_path / "o.safetensors")["out"]
    assert out.dtype == result_dtype
    assert metadata(tmp_path / "o.safetensors")["dtype"] == str(result_dtype).removeprefix("torch.")
    assert torch.equal(out, expected_out(tensors, dtype=result_dtype))


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.uint8, torch.float32, torch.float16])
def test_numeric_zero_one_mask_is_converted(tmp_path, mask_dtype):
    tensors = random_inputs()
    as_numbers = dict(tensors, valid=tensors["valid"].to(mask_dtype))
    source = write(tmp_path / "in.safetensors", as_numbers)
    assert invoke("normalize", source, tmp_path / "o.safetensors").exit_code == 0
    assert torch.equal(read(tmp_path / "o.safetensors")["out"], expected_out(tensors))


@pytest.mark.parametrize("bad", [2, -1, 0.5, math.nan])
def test_mask_with_other_values_is_an_error(tmp_path, bad):
    tensors = random_inputs()
    valid = tensors["valid"].float()
    valid[1, 2] = bad
    source = write(tmp_path / "in.safetensors", dict(tensors, valid=valid))
    result = invoke("normalize", source, tmp_path / "o.safetensors")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "in.safetensors", "'valid'", "0 and 1", "[1, 2]")
    assert not (tmp_path / "o.safetensors").exists()


def test_absent_valid_scale_bias_default_with_notes(tmp_path):
    x = torch.randn(4, 6)
    source = write(tmp_path / "in.safetensors", {"x": x})
    result = invoke("normalize", source, tmp_path / "o.safetensors")
    assert result.exit_code == 0
    for fragment in ("no tensor 'valid'", "no tensor 'scale'", "no tensor 'bias'"):
        assert fragment in result.stderr
    expected = masked_layer_normalization(
        x, torch.ones(4, dtype=torch.bool), torch.ones(6), torch.zeros(6)
    )
    assert torch.equal(read(tmp_path / "o.safetensors")["out"], expected)
    quiet = invoke("normalize", source, tmp_path / "o.safetensors", "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr == ""


@pytest.mark.parametrize("option", ["--valid-key", "--scale-key", "--bias-key", "--grad-out-key"])
def test_explicit_key_that_is_missing_is_an_error(tmp_path, option):
    source = write(tmp_path / "in.safetensors", random_inputs())
    result = invoke("normalize", source, tmp_path / "o.safetensors", option, "nope")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "in.safetensors", "no tensor 'nope'")


# --- gradients ----------------------------------------------------------------------------------


def autograd_gradients(tensors, eps=1e-5):
    leaves = [tensors[k].clone().requires_grad_() for k in ("x", "scale", "bias")]
    out = masked_layer_normalization(leaves[0], tensors["valid"], leaves[1], leaves[2], eps)
    return dict(
        zip(
            ("grad_x", "grad_scale", "grad_bias"),
            torch.autograd.grad(out, leaves, tensors["grad_out"]),
            strict=True,
        )
    )


def test_gradients_when_input_holds_grad_out(tmp_path):
    tensors = random_inputs((6, 7, 12), dtype=torch.float64)
    tensors["grad_out"] = torch.randn(6, 7, 12, dtype=torch.float64)
    source = write(tmp_path / "in.safetensors", tensors)
    assert invoke("normalize", source, tmp_path / "o.safetensors").exit_code == 0
    produced = read(tmp_path / "o.safetensors")
    assert set(produced) == {"out", "grad_x", "grad_scale", "grad_bias"}
    for key, want in autograd_gradients(tensors).items():
        torch.testing.assert_close(produced[key], want, rtol=1e-12, atol=1e-12)
    # and against the float64 reference's own autograd
    leaves = [tensors[k].clone().requires_grad_() for k in ("x", "scale", "bias")]
    reference = reference_masked_layer_norm(leaves[0], tensors["valid"], leaves[1], leaves[2])
    grads = torch.autograd.grad(reference, leaves, tensors["grad_out"])
    for key, want in zip(("grad_x", "grad_scale", "grad_bias"), grads, strict=True):
        torch.testing.assert_close(produced[key], want, rtol=1e-10, atol=1e-10)


def test_grad_out_from_another_file_and_key(tmp_path):
    tensors = random_inputs()
    grad_out = torch.randn(tensors["x"].shape)
    source = write(tmp_path / "in.safetensors", tensors)
    upstream = write(tmp_path / "g.safetensors", {"dy": grad_out})
    result = invoke(
        "normalize",
        source,
        tmp_path / "o.safetensors",
        "--grad-out",
        upstream,
        "--grad-out-key",
        "dy",
    )
    assert result.exit_code == 0, result.stderr
    produced = read(tmp_path / "o.safetensors")
    want = autograd_gradients(dict(tensors, grad_out=grad_out))
    assert torch.equal(produced["grad_x"], want["grad_x"])


@pytest.mark.parametrize(
    ("dtype", "grad_dtype", "huge"),
    [
        (torch.float16, torch.bfloat16, 1e29),
        (torch.float16, torch.float32, 1e6),
        (torch.float32, torch.float64, 1e300),
    ],
)
def test_grad_out_beyond_the_dtypes_range_gives_the_rounded_truth_not_nan(
    tmp_path, dtype, grad_dtype, huge
):
    """A finite grad_out too large for x's dtype: each gradient is the float64 truth rounded
    to the dtype (inf where it overflows), never NaN, and verify passes it. (It once reached
    the op as inf, and inf - inf made NaN.)"""
    tensors = random_inputs((2, 3, 4), dtype=dtype, seed=3)
    grad_out = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(4)).to(grad_dtype)
    valid = tensors["valid"]
    valid[1, 2], valid[0, 0] = True, False
    tensors["x"][1, 2] = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=dtype)
    grad_out[1, 2, 0] = huge  # a valid row: its gradients overflow
    grad_out[0, 0, 1] = huge  # padding: never reaches anything
    tensors["grad_out"] = grad_out
    source = write(tmp_path / "in.safetensors", tensors)
    target = tmp_path / "o.safetensors"
    result = invoke("normalize", source, target)
    assert result.exit_code == 0, result.stderr
    produced = read(target)
    leaves = [tensors[k].double().requires_grad_() for k in ("x", "scale", "bias")]
    truth = reference_masked_layer_norm(leaves[0], valid, leaves[1], leaves[2])
    grads = torch.autograd.grad(truth, leaves, grad_out.double())
    for key, want in zip(("grad_x", "grad_scale", "grad_bias"), grads, strict=True):
        got = produced[key]
        assert not got.isnan().any(), (key, got)
        assert torch.equal(got.isinf(), want.to(dtype).isinf()), (key, got, want)
        torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=2e-3, atol=1e-5)
    assert produced["grad_x"][1, 2].isinf().any()  # the case is what it says
    assert produced["grad_x"][0, 0].eq(0).all()
    verdict = invoke("verify", source, target)
    assert verdict.exit_code == 0, verdict.stdout + verdict.stderr


def test_grad_out_of_wrong_shape_is_an_error(tmp_path):
    tensors = dict(random_inputs(), grad_out=torch.randn(2, 2))
    source = write(tmp_path / "in.safetensors", tensors)
    result = invoke("normalize", source, tmp_path / "o.safetensors")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "'grad_out'", "shape [2, 2]")


# --- many files ---------------------------------------------------------------------------------


def test_many_inputs_into_an_out_dir(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    inputs = []
    for index in range(3):
        tensors = random_inputs(seed=index)
        inputs.append((write(tmp_path / "in" / f"a{index}.safetensors", tensors), tensors))
    result = invoke("normalize", *[p for p, _ in inputs], "--out-dir", tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    for path, tensors in inputs:
        assert torch.equal(read(tmp_path / "out" / path.name)["out"], expected_out(tensors))
    assert result.stderr.count("wrote") == 3


def test_one_bad_input_in_a_batch_fails_alone(tmp_path):
    good = write(tmp_path / "good.safetensors", random_inputs())
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    (tmp_path / "out").mkdir()
    result = invoke("normalize", bad, good, "--out-dir", tmp_path / "out")
    assert result.exit_code == 2
    assert (tmp_path / "out" / "good.safetensors").exists()
    assert not (tmp_path / "out" / "bad.safetensors").exists()
    assert "bad.safetensors" in result.stderr and "1 of 2 inputs failed" in result.stderr


def test_batch_with_clashing_names_is_refused_before_any_work(tmp_path):
    for folder in ("a", "b", "out"):
        (tmp_path / folder).mkdir()
    first = write(tmp_path / "a" / "x.safetensors", random_inputs())
    second = write(tmp_path / "b" / "x.safetensors", random_inputs())
    result = invoke("normalize", first, second, "--out-dir", tmp_path / "out")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "would both write x.safetensors")
    assert list((tmp_path / "out").iterdir()) == []


def test_batch_creates_its_out_dir_but_not_its_parents(tmp_path):
    source = write(tmp_path / "a.safetensors", random_inputs())
    assert invoke("normalize", source, "--out-dir", tmp_path / "new").exit_code == 0
    assert (tmp_path / "new" / "a.safetensors").exists()
    result = invoke("normalize", source, "--out-dir", tmp_path / "no" / "such")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "--out-dir", "cannot create")


def test_wrong_number_of_paths_without_out_dir(tmp_path):
    source = write(tmp_path / "a.safetensors", random_inputs())
    result = invoke("normalize", source, source, source)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "INPUT OUTPUT", "--out-dir")


# --- pipelines (real processes) -----------------------------------------------------------------


def test_stdin_to_stdout_pipeline_equals_file_to_file(tmp_path):
    by_path = tmp_path / "by_path.safetensors"
    assert run("normalize", PAIRS, by_path).returncode == 0
    with open(PAIRS, "rb") as stdin:
        piped = run("normalize", "-", "-", stdin=stdin)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == by_path.read_bytes()
    assert b"<stdin>" not in piped.stdout


def test_generate_normalize_inspect_pipeline():
    generated = run("generate", "-", "--shape", "3,10,16", "--seed", "4")
    assert generated.returncode == 0
    normalized = run("normalize", "-", "-", input=generated.stdout)
    assert normalized.returncode == 0, normalized.stderr
    inspected = run("inspect", "--json", "-", input=normalized.stdout)
    assert inspected.returncode == 0
    assert b'"name": "out"' in inspected.stdout


def test_refuses_to_write_binary_to_a_terminal():
    controller, terminal = pty.openpty()
    try:
        result = run("normalize", WORKED, "-", stdout=terminal)
    finally:
        os.close(terminal)
        os.close(controller)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "<stdout>", "terminal")


def test_stdin_that_is_not_safetensors(tmp_path):
    result = run("normalize", "-", tmp_path / "o.safetensors", input=b"\x00" * 5)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "<stdin>", "not a valid safetensors file")


def test_write_failure_to_stdout_exits_2():
    with open("/dev/full", "wb") as full:
        result = run("normalize", PAIRS, "-", stdout=full)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "<stdout>", "No space left on device")


# --- bad input: one line, exit 2, nothing written -----------------------------------------------


def bad_files(tmp_path: Path) -> dict[str, tuple[Path, tuple[str, ...]]]:
    good = write(tmp_path / "good.safetensors", random_inputs())
    data = good.read_bytes()
    cases = {}

    def case(name, tensors=None, raw=None, meta=None, fragments=()):
        path = tmp_path / f"{name}.safetensors"
        if raw is not None:
            path.write_bytes(raw)
        else:
            write(path, tensors, **(meta or {}))
        cases[name] = (path, (path.name, *fragments))

    case("random_bytes", raw=os.urandom(64), fragments=("not a valid safetensors file",))
    case("empty", raw=b"", fragments=("not a valid safetensors file",))
    case("truncated", raw=data[:-10], fragments=("not a valid safetensors file",))
    case("corrupt_header", raw=data[:8] + b"[" + data[9:], fragments=("not a valid",))
    inputs = random_inputs()
    case("missing_x", {"valid": inputs["valid"]}, fragments=("no tensor 'x'",))
    case("int_x", dict(inputs, x=inputs["x"].long()), fragments=("'x'", "int64"))
    case("zero_d_x", {"x": torch.tensor(1.0)}, fragments=("'x'", "0-d"))
    case("no_channels", {"x": torch.zeros(3, 0)}, fragments=("'x'", "zero channels"))
    case("valid_shape", dict(inputs, valid=inputs["valid"][:, :2]), fragments=("'valid'", "shape"))
    case("scale_shape", dict(inputs, scale=torch.ones(3)), fragments=("'scale'", "[8]"))
    case("scale_rank", dict(inputs, scale=torch.ones(1, 8)), fragments=("'scale'", "[1, 8]"))
    case(
        "bias_complex",
        dict(inputs, bias=torch.ones(8, dtype=torch.complex64)),
        fragments=("'bias'",),
    )
    case("eps_text", inputs, meta={"eps": "tiny"}, fragments=("metadata 'eps'", "'tiny'"))
    case("eps_negative", inputs, meta={"eps": "-1"}, fragments=("metadata 'eps'",))
    case("eps_nan", inputs, meta={"eps": "nan"}, fragments=("metadata 'eps'",))
    return cases


def test_each_bad_input_gives_one_line_and_exit_2(tmp_path):
    output = tmp_path / "existing.safetensors"
    output.write_bytes(b"precious")
    for name, (path, fragments) in bad_files(tmp_path).items():
        result = invoke("normalize", path, output)
        assert result.exit_code == 2, (name, result.stdout, result.stderr)
        assert_one_line_error(result.stderr, *fragments)
        assert output.read_bytes() == b"precious", name
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("make_path", "fragments"),
    [
        (lambda d: d / "absent.safetensors", ("absent.safetensors", "no such file")),
        (lambda d: d, ("is a folder",)),
    ],
)
def test_missing_input_or_folder(tmp_path, make_path, fragments):
    result = invoke("normalize", make_path(tmp_path), tmp_path / "o.safetensors")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, *fragments)


@pytest.mark.parametrize(
    ("make_output", "fragments"),
    [
        (lambda d: d / "no" / "such" / "o.safetensors", ("does not exist",)),
        (lambda d: d, ("is a folder",)),
        (lambda d: Path("/proc/maskln-test.safetensors"), ("/proc/maskln-test.safetensors",)),
    ],
)
def test_output_that_cannot_be_written(tmp_path, make_output, fragments):
    result = invoke("normalize", WORKED, make_output(tmp_path))
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, *fragments)


def test_bad_eps_option():
    result = invoke("normalize", WORKED, "-", "--eps", "-1")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "--eps")


# --- nothing lost: atomic output ----------------------------------------------------------------


@pytest.mark.parametrize(
    "failure", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()]
)
def test_failure_mid_write_leaves_existing_output_untouched(tmp_path, monkeypatch, failure):
    tensors = random_inputs((64, 8))
    source = write(tmp_path / "in.safetensors", tensors)
    output = tmp_path / "out.safetensors"
    output.write_bytes(b"the previous result")
    real_write = normalize_module.SafetensorsWriter.write
    calls = []

    def failing_write(self, key, chunk):
        calls.append(key)
        if len(calls) == 3:  # a few chunks in
            if isinstance(failure, OSError):
                self._stream.write = lambda data: (_ for _ in ()).throw(failure)
            else:
                raise failure
        real_write(self, key, chunk)

    monkeypatch.setattr(normalize_module.SafetensorsWriter, "write", failing_write)
    result = invoke("normalize", source, output, "--chunk-rows", 4)
    assert result.exit_code == (2 if isinstance(failure, OSError) else 130)
    assert len(calls) == 3
    assert output.read_bytes() == b"the previous result"
    assert leftovers(tmp_path) == []
    if isinstance(failure, OSError):
        assert_one_line_error(result.stderr, "out.safetensors", "No space left on device")


def test_output_replaces_existing_file_with_normal_permissions(tmp_path):
    output = tmp_path / "out.safetensors"
    output.write_bytes(b"old")
    assert invoke("normalize", WORKED, output).exit_code == 0
    assert read(output)["out"].shape == (1, 2, 2)
    assert output.stat().st_mode & 0o777 == 0o666 & ~current_umask()
    assert leftovers(tmp_path) == []


def test_an_input_is_never_overwritten(tmp_path):
    path = write(tmp_path / "in.safetensors", random_inputs())
    before = path.read_bytes()
    link = tmp_path / "link.safetensors"
    link.symlink_to(path)
    for args in ([path, path], [path, link], [path, "--out-dir", tmp_path]):
        result = invoke("normalize", *args)
        assert result.exit_code == 2
        assert_one_line_error(result.stderr, "is the input")
    assert path.read_bytes() == before and link.is_symlink()


def test_a_symlinked_output_writes_its_target(tmp_path):
    target = tmp_path / "target.safetensors"
    target.write_bytes(b"old")
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    assert invoke("normalize", WORKED, link).exit_code == 0
    assert link.is_symlink() and read(target)["out"].shape == (1, 2, 2)


def test_a_device_output_is_written_to_not_replaced():
    assert invoke("normalize", WORKED, "/dev/null").exit_code == 0
    result = invoke("normalize", WORKED, "/dev/full")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "/dev/full", "No space left on device")
    for device in ("/dev/null", "/dev/full"):
        assert stat.S_ISCHR(os.stat(device).st_mode), device


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("command", ["normalize", "generate"])
@pytest.mark.parametrize("durable", [False, True])
def test_fsync_flushes_the_file_and_then_its_folder_only_when_asked(
    tmp_path, monkeypatch, command, durable
):
    """Without --fsync the output is still renamed into place whole; with it, the file is
    flushed before the rename and the folder (the rename) after."""
    import maskln_cli.files.output as tensorfile

    source = tmp_path / "in.safetensors"
    assert invoke("generate", source, "--shape", "3,4,8", "--quiet").exit_code == 0
    output = tmp_path / "out.safetensors"
    flushed: list[tuple[str, bool]] = []

    def recording_fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        flushed.append((path, output.exists()))

    monkeypatch.setattr(tensorfile.os, "fsync", recording_fsync)
    args = [source, output] if command == "normalize" else [output, "--shape", "3,4,8"]
    result = invoke(command, *args, *(["--fsync"] if durable else []), "--quiet")
    assert result.exit_code == 0, result.stderr
    assert output.exists()
    if not durable:
        assert flushed == []
    else:
        (file_path, renamed_yet), (folder_path, renamed) = flushed
        # the new file, beside OUTPUT: anonymous (O_TMPFILE), or hidden where there are none
        folder, name = os.path.split(file_path)
        assert folder == str(tmp_path)
        assert name.endswith(" (deleted)") or (
            name.startswith(".out.safetensors.") and name.endswith(".partial")
        )
        assert not renamed_yet and folder_path == str(tmp_path) and renamed


# --- the background writer -------------------------------------------------------------------


def _background(stream, length=12, depth=2):
    from maskln_cli.files.output import BackgroundWriter, SafetensorsWriter

    writer = SafetensorsWriter(stream, "mem", {"t": ("float32", (length,))})
    return BackgroundWriter(writer, depth)


def test_background_writer_writes_what_the_direct_writer_writes():
    import io

    from maskln_cli.files.output import SafetensorsWriter

    chunks = [torch.randn(3) for _ in range(4)]
    direct = io.BytesIO()
    writer = SafetensorsWriter(direct, "mem", {"t": ("float32", (12,))})
    for chunk in chunks:
        writer.write("t", chunk)
    writer.close()
    background = io.BytesIO()
    with _background(background) as writing:
        for chunk in chunks:
            writing.write("t", chunk)
    assert background.getvalue() == direct.getvalue()
    assert torch.equal(safetensors.torch.load(background.getvalue())["t"], torch.cat(chunks))


class _FailingStream:
    """A stream whose ``fail_at``-th write raises ENOSPC; counts the writes it was asked for."""

    def __init__(self, fail_at):
        self.fail_at, self.writes = fail_at, 0

    def write(self, data):
        self.writes += 1
        if self.writes == self.fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return len(data)

    def flush(self):
        pass


def test_background_writer_raises_a_write_error_in_the_caller_and_writes_nothing_more():
    stream = _FailingStream(fail_at=3)  # the header, a chunk, then the failing chunk
    writing = _background(stream, length=30)
    with pytest.raises(MasklnError, match="mem: cannot write: No space left on device"), writing:
        for _ in range(10):
            writing.write("t", torch.zeros(3))
    writing._thread.join(timeout=10)  # it ends by itself, without writing more
    assert not writing._thread.is_alive()
    assert stream.writes == 3


def test_background_writer_stops_when_the_caller_fails():
    stream = _FailingStream(fail_at=0)
    writing = _background(stream, length=30, depth=1)
    with pytest.raises(KeyboardInterrupt), writing:
        writing.write("t", torch.zeros(3))
        raise KeyboardInterrupt
    writing._thread.join(timeout=10)  # it ends by itself, without writing more
    assert not writing._thread.is_alive()
    assert stream.writes <= 2  # the header, and the chunk if it was taken before the stop
