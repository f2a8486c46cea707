"""`maskln diff` and `maskln verify`: verdicts, exit codes, reports and JSON."""

from __future__ import annotations

import json
import math

import pytest
import torch

from maskln_cli import masked_layer_normalization
from tests.clitools import PAIRS, WORKED, assert_one_line_error, invoke, run, write

EXPECTED_PAIRS = PAIRS.with_name("pair_features_expected.safetensors")

REPORT_KEYS = {
    "name", "passed", "problems", "shape", "expected_shape", "dtype", "expected_dtype", "rtol",
    "atol", "numel", "rows", "mismatched", "mismatched_fraction", "mismatched_rows",
    "max_abs_diff", "max_abs_index", "max_rel_diff", "max_rel_index", "rel_l2", "nan_mismatched",
    "inf_mismatched", "invalid_rows_zero", "worst", "rows_left_out",
}  # fmt: skip


def pair(tmp_path, actual, expected):
    return (
        write(tmp_path / "actual.safetensors", actual),
        write(tmp_path / "expected.safetensors", expected),
    )


# --- diff ---------------------------------------------------------------------------------------


def test_diff_identical_files_passes():
    result = invoke("diff", WORKED, WORKED)
    assert result.exit_code == 0
    assert "PASS" in result.stdout and "bias, scale, x, valid" in result.stdout


def test_diff_mismatch_report_for_people(tmp_path):
    expected = torch.zeros(4, 3)
    actual = expected.clone()
    actual[2, 1] = 0.75
    paths = pair(
        tmp_path, {"out": actual, "same": torch.ones(2)}, {"out": expected, "same": torch.ones(2)}
    )
    result = invoke("diff", *paths)
    assert result.exit_code == 1
    text = result.stdout
    for fragment in (
        "FAIL out",
        "1 of 12",
        "in 1 of 4 rows",
        "0.75 at [2, 1]",
        "worst rows of out",
        "PASS same",
    ):
        assert fragment in text, fragment
    assert text.strip().splitlines()[-1].startswith("FAIL: 1 of 2 tensors: out")


def test_diff_json_document(tmp_path):
    expected = torch.zeros(4, 3, dtype=torch.float64)
    actual = expected.clone()
    actual[3, 0] = math.nan
    paths = pair(
        tmp_path,
        {"out": actual, "extra": torch.ones(1)},
        {"out": expected, "only_e": torch.ones(2)},
    )
    result = invoke("diff", *paths, "--json")
    assert result.exit_code == 1
    document = json.loads(result.stdout)
    assert document["passed"] is False and document["command"] == "diff"
    tensors = {t["name"]: t for t in document["tensors"]}
    assert set(tensors) == {"out", "extra", "only_e"}
    assert all(set(t) == REPORT_KEYS for t in document["tensors"])
    out = tensors["out"]
    assert (out["mismatched"], out["nan_mismatched"], out["shape"]) == (1, 1, [4, 3])
    assert out["worst"][0]["index"] == [3, 0] and out["worst"][0]["row"] == [3]
    assert out["worst"][0]["actual"] is None  # NaN is null in JSON
    assert tensors["extra"]["problems"] == ["missing in expected"]
    assert tensors["only_e"]["problems"] == ["missing in actual"]
    assert tensors["only_e"]["shape"] is None and tensors["only_e"]["expected_shape"] == [2]


def test_diff_key_option_limits_the_comparison(tmp_path):
    paths = pair(
        tmp_path,
        {"a": torch.ones(2), "b": torch.ones(2)},
        {"a": torch.ones(2), "b": torch.zeros(2)},
    )
    assert invoke("diff", *paths, "--key", "a").exit_code == 0
    assert invoke("diff", *paths, "--key", "a", "--key", "b").exit_code == 1
    unknown = invoke("diff", *paths, "--key", "zzz")
    assert unknown.exit_code == 2
    assert_one_line_error(unknown.stderr, "--key", "'zzz'")


def test_diff_tolerance_options(tmp_path):
    paths = pair(
        tmp_path,
        {"t": torch.tensor([1.5], dtype=torch.float64)},
        {"t": torch.tensor([1.0], dtype=torch.float64)},
    )
    assert invoke("diff", *paths).exit_code == 1
    assert invoke("diff", *paths, "--rtol", "0.25", "--atol", "0.25").exit_code == 0
    assert invoke("diff", *paths, "--rtol", "0.25", "--atol", "0.24").exit_code == 1


def test_diff_quiet_prints_only_the_verdict(tmp_path):
    paths = pair(tmp_path, {"t": torch.ones(3)}, {"t": torch.zeros(3)})
    result = invoke("diff", *paths, "--quiet")
    assert result.exit_code == 1
    assert result.stdout.strip().splitlines() == [
        "FAIL: 1 of 1 tensors: t (3 of 3 elements differ beyond tolerance)"
    ]


def test_diff_from_stdin_pipeline(tmp_path):
    with open(PAIRS, "rb") as stdin:
        normalized = run("normalize", "-", "-", stdin=stdin)
    result = run("diff", "-", EXPECTED_PAIRS, input=normalized.stdout)
    assert result.returncode == 0, result.stdout
    assert b"PASS" in result.stdout


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("-", "-"), ("both be '-'",)),
        (("missing.safetensors", WORKED), ("missing.safetensors", "no such file")),
        ((WORKED, WORKED, "--rtol", "-1"), ("--rtol",)),
        ((WORKED, WORKED, "--atol", "nan"), ("--atol",)),
    ],
)
def test_diff_errors_exit_2(args, fragments):
    result = invoke("diff", *args)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, *fragments)


# --- verify -------------------------------------------------------------------------------------


def test_verify_sample_passes_with_gradients():
    result = invoke("verify", PAIRS, EXPECTED_PAIRS, "--json")
    assert result.exit_code == 0, result.stdout
    document = json.loads(result.stdout)
    assert document["passed"] is True
    names = [t["name"] for t in document["tensors"]]
    assert names == ["out", "grad_x", "grad_scale", "grad_bias"]
    out = document["tensors"][0]
    assert out["invalid_rows_zero"] is True and out["numel"] == 2 * 48 * 48 * 32


def kernel_files(tmp_path, grad=True):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 6, 16, generator=generator)
    valid = torch.rand(5, 6, generator=generator) > 0.3
    x[~valid] = math.nan
    scale, bias = torch.randn(16, generator=generator), torch.randn(16, generator=generator)
    inputs = {"x": x, "valid": valid, "scale": scale, "bias": bias}
    if grad:
        inputs["grad_out"] = torch.randn(5, 6, 16, generator=generator)
    leaves = [t.clone().requires_grad_() for t in (x, scale, bias)]
    out = masked_layer_normalization(leaves[0], valid, leaves[1], leaves[2])
    expected = {"out": out.detach()}
    if grad:
        grads = torch.autograd.grad(out, leaves, inputs["grad_out"])
        expected.update(zip(("grad_x", "grad_scale", "grad_bias"), grads, strict=True))
    return inputs, expected, valid


def test_verify_finds_a_wrong_row(tmp_path):
    inputs, expected, valid = kernel_files(tmp_path)
    row = tuple(valid.nonzero()[0].tolist())
    expected["out"][row] += 0.01  # a kernel that gets one row wrong
    source = write(tmp_path / "in.safetensors", inputs)
    kernel = write(tmp_path / "kernel.safetensors", expected)
    result = invoke("verify", source, kernel)
    assert result.exit_code == 1
    assert "FAIL out" in result.stdout and "in 1 of 30 rows" in result.stdout
    assert "PASS grad_x" in result.stdout
    document = json.loads(invoke("verify", source, kernel, "--json").stdout)
    out = document["tensors"][0]
    assert out["mismatched_rows"] == 1 and {w["row"][0] for w in out["worst"]} == {row[0]}
    assert all(w["row"] == list(row) for w in out["worst"])


def test_verify_requires_exact_zeros_at_invalid_positions(tmp_path):
    inputs, expected, valid = kernel_files(tmp_path)
    expected["out"][~valid] = 1e-8  # within tolerance, but padding leaks
    source = write(tmp_path / "in.safetensors", inputs)
    kernel = write(tmp_path / "kernel.safetensors", expected)
    document = json.loads(invoke("verify", source, kernel, "--json").stdout)
    out = document["tensors"][0]
    assert out["mismatched"] == 0 and out["invalid_rows_zero"] is False and not out["passed"]


def test_verify_checks_gradients(tmp_path):
    inputs, expected, _ = kernel_files(tmp_path)
    expected["grad_scale"][3] *= 1.5
    source = write(tmp_path / "in.safetensors", inputs)
    kernel = write(tmp_path / "kernel.safetensors", expected)
    document = json.loads(invoke("verify", source, kernel, "--json").stdout)
    verdicts = {t["name"]: t["passed"] for t in document["tensors"]}
    assert verdicts == {"out": True, "grad_x": True, "grad_scale": False, "grad_bias": True}
    scale = next(t for t in document["tensors"] if t["name"] == "grad_scale")
    assert scale["max_abs_index"] == [3] and scale["mismatched"] == 1


def test_verify_only_the_gradients_expected_holds(tmp_path):
    inputs, expected, _ = kernel_files(tmp_path)
    del expected["grad_scale"], expected["grad_bias"]
    source = write(tmp_path / "in.safetensors", inputs)
    kernel = write(tmp_path / "kernel.safetensors", expected)
    result = invoke("verify", source, kernel, "--json")
    assert result.exit_code == 0
    assert [t["name"] for t in json.loads(result.stdout)["tensors"]] == ["out", "grad_x"]


def test_verify_notes_gradients_it_cannot_check(tmp_path):
    inputs, expected, _ = kernel_files(tmp_path)
    del inputs["grad_out"]
    source = write(tmp_path / "in.safetensors", inputs)
    kernel = write(tmp_path / "kernel.safetensors", expected)
    result = invoke("verify", source, kernel)
    assert result.exit_code == 0
    assert "gradients were not checked" in result.stdout


def test_verify_missing_out_and_wrong_dtype_are_mismatches(tmp_path):
    inputs, expected, _ = kernel_files(tmp_path, grad=False)
    source = write(tmp_path / "in.safetensors", inputs)
    renamed = write(tmp_path / "renamed.safetensors", {"result": expected["out"]})
    document = json.loads(invoke("verify", source, renamed, "--json").stdout)
    assert document["tensors"][0]["problems"] == [
        "missing in expected (it holds 'result'; --out-key names the result)"
    ]
    assert invoke("verify", source, renamed, "--out-key", "result").exit_code == 0
    double = write(tmp_path / "double.safetensors", {"out": expected["out"].double()})
    result = invoke("verify", source, double)
    assert result.exit_code == 1
    assert "dtype float32 vs expected float64 (--dtype float64 computes in it)" in result.stdout
    assert (
        invoke(
            "verify", source, double, "--dtype", "float64", "--rtol", "1e-5", "--atol", "1e-6"
        ).exit_code
        == 0
    )


def test_verify_uses_normalize_options(tmp_path):
    inputs, expected, _ = kernel_files(tmp_path, grad=False)
    source = write(tmp_path / "in.safetensors", {"acts": inputs["x"], "valid": inputs["valid"]})
    checkpoint = write(
        tmp_path / "ckpt.safetensors", {"ln.weight": inputs["scale"], "ln.bias": inputs["bias"]}
    )
    kernel = write(tmp_path / "kernel.safetensors", expected)
    args = [
        "--x-key",
        "acts",
        "--params",
        checkpoint,
        "--scale-key",
        "ln.weight",
        "--bias-key",
        "ln.bias",
    ]
    assert invoke("verify", source, kernel, *args).exit_code == 0
    assert invoke("verify", source, kernel, *args, "--eps", "0.5").exit_code == 1


def test_verify_expected_from_stdin():
    result = run("verify", PAIRS, "-", input=EXPECTED_PAIRS.read_bytes())
    assert result.returncode == 0 and b"PASS" in result.stdout


def test_verify_errors_exit_2(tmp_path):
    result = invoke("verify", tmp_path / "nope.safetensors", EXPECTED_PAIRS)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "nope.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x01" * 100)
    result = invoke("verify", PAIRS, garbage)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "garbage.safetensors", "not a valid safetensors file")


def test_chunked_verify_equals_whole(tmp_path):
    whole = json.loads(invoke("verify", PAIRS, EXPECTED_PAIRS, "--json").stdout)
    chunked = json.loads(
        invoke("verify", PAIRS, EXPECTED_PAIRS, "--json", "--chunk-rows", "7").stdout
    )
    for a, b in zip(whole["tensors"], chunked["tensors"], strict=True):
        if a["name"] in ("out", "grad_x"):  # per-row results are identical whatever the chunks
            assert b["rel_l2"] == pytest.approx(a["rel_l2"], rel=1e-12)  # a sum, in chunks
            assert dict(a, rel_l2=None) == dict(b, rel_l2=None)
        else:
            assert a["passed"] == b["passed"]
