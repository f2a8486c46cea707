"""`maskln verify INPUT RESULT`: roles, the float64 truth, the budget's options, what must be
checked, the padding, the report and JSON. (Kernels judged by the budget: test_verify_kernels.py.)
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from maskln_cli import masked_layer_normalization
from maskln_cli.op.reference import reference_masked_layer_norm
from tests import kernels
from tests.clitools import PAIRS, WORKED, assert_one_line_error, invoke, read, run, write

EXPECTED_PAIRS = PAIRS.with_name("pair_features_expected.safetensors")
GRADIENTS = ("grad_x", "grad_scale", "grad_bias")


def files(tmp_path, inputs, result, **metadata):
    """INPUT and RESULT written to files; eps in INPUT's metadata unless told otherwise."""
    metadata = metadata or {"eps": "1e-05"}
    source = write(tmp_path / "in.safetensors", inputs, **metadata)
    return source, write(tmp_path / "result.safetensors", result)


def verify_json(*args):
    result = invoke("verify", *args, "--json")
    assert result.exit_code in (0, 1), result.stderr
    document = json.loads(result.stdout)
    assert document["passed"] is (result.exit_code == 0)
    return document


def tensors(document):
    return {t["name"]: t for t in document["tensors"]}


def batch(seed=3, grad=True, offset=0.0):
    inputs = kernels.offset_batch(offset, seed, shape=(4, 16, 32))
    if not grad:
        del inputs["grad_out"]
    return inputs


def float64_truth(inputs):
    """The plain float64 formula (reference.py) and its autograd gradients: independent of
    maskln's op, which verify's truth uses."""
    x, scale, bias = (inputs[k].double().requires_grad_() for k in ("x", "scale", "bias"))
    out = reference_masked_layer_norm(x, inputs["valid"], scale, bias, 1e-5)
    truth = {"out": out.detach()}
    if "grad_out" in inputs:
        upstream = torch.where(inputs["valid"][..., None], inputs["grad_out"].double(), 0.0)
        grads = torch.autograd.grad(out, (x, scale, bias), upstream)
        truth.update(zip(GRADIENTS, grads, strict=True))
    return truth


# --- roles and the float64 truth ----------------------------------------------------------------


def test_sample_passes_with_gradients():
    document = verify_json(PAIRS, EXPECTED_PAIRS)
    assert document["passed"] is True
    assert [t["name"] for t in document["tensors"]] == ["out", *GRADIENTS]
    out = tensors(document)["out"]
    assert out["invalid_rows_zero"] is True and out["numel"] == 2 * 48 * 48 * 32


def test_result_is_the_actual_side_and_the_tolerance_scales_with_the_reference(tmp_path):
    # One valid row [1, 3], eps 3: the truth is [-0.5, 0.5]. RESULT errs by 0.3 at 0.5.
    inputs = {"x": torch.tensor([[1.0, 3.0]], dtype=torch.float64)}
    result = {"out": torch.tensor([[-0.5, 0.8]], dtype=torch.float64)}
    source, target = files(tmp_path, inputs, result, eps="3.0")
    # rtol 0.5 scales with the reference's 0.5 (0.25 < 0.3): a failure. Scaled with RESULT's
    # 0.8 (0.4), as when RESULT was the expected side, it would pass.
    document = verify_json(source, target, "--rtol", "0.5", "--atol", "0")
    out = tensors(document)["out"]
    assert not document["passed"]
    assert (document["actual"], document["expected"]) == (str(target), str(source))
    assert out["worst"][0]["actual"] == 0.8 and out["worst"][0]["expected"] == 0.5
    assert out["worst"][0]["allowed"] == pytest.approx(0.25)
    assert verify_json(source, target, "--rtol", "0.61", "--atol", "0")["passed"]


def test_errors_are_measured_against_float64_truth_whatever_the_results_dtype(tmp_path):
    inputs = batch(offset=1e3)
    result = kernels.run(kernels.torch_layer_norm, inputs)  # float32, as PyTorch computes it
    source, target = files(tmp_path, inputs, result)
    document = verify_json(source, target)
    truth = float64_truth(inputs)
    # verify runs its yardstick a block of rows at a time on one thread each: the sums over
    # rows (grad_scale, grad_bias) round as torch's do on one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = kernels.run(kernels.torch_layer_norm, inputs)
    finally:
        torch.set_num_threads(threads)
    assert document["passed"] and document["result_dtype"] == "float32"
    for name, figures in tensors(document).items():
        error = (result[name].double() - truth[name]).abs()
        assert figures["max_abs_diff"] == pytest.approx(float(error.max()), rel=1e-9), name
        relative = float(error.norm() / truth[name].norm())
        assert figures["rel_l2"] == pytest.approx(relative, rel=1e-9), name
        # The yardstick is this very computation, so it errs exactly as much.
        own = float((one_thread[name].double() - truth[name]).abs().max())
        assert figures["yardstick_max_abs_diff"] == pytest.approx(own), name
        assert figures["expected_dtype"] == "float64" and figures["dtype"] == "float32"
        assert not any("dtype" in p for p in figures["problems"])
    # A float64 result is judged as a float64 kernel: maskln's in float64 passes as it is.
    double = kernels.run(kernels.maskln, inputs, torch.float64)
    target = write(tmp_path / "double.safetensors", double)
    document = verify_json(source, target)
    assert document["passed"] and document["result_dtype"] == "float64"
    # ... and the float32 kernel's result stored as float64 fails the float64 budget,
    # saying how to judge it as float32.
    widened = write(tmp_path / "widened.safetensors", {k: v.double() for k, v in result.items()})
    document = verify_json(source, widened)
    assert not document["passed"]
    assert any("--dtype float32" in note for note in document["notes"])
    assert verify_json(source, widened, "--dtype", "float32")["passed"]


def test_json_carries_what_the_comparison_was_made_with(tmp_path):
    inputs = batch()
    source, target = files(tmp_path, inputs, kernels.run(kernels.two_pass, inputs))
    document = verify_json(source, target)
    valid = inputs["valid"]
    assert document["eps"] == 1e-05 and document["eps_source"] == "metadata 'eps'"
    assert (document["rows"], document["valid_rows"]) == (valid.numel(), int(valid.sum()))
    assert document["result_dtype"] == "float32" and document["tolerance"] == "budget"
    assert document["factor"] == 3.0 and document["checked"] == ["out", *GRADIENTS]
    for figures in document["tensors"]:
        assert 0 < figures["budget_ratio"] <= 1
        assert figures["yardstick_max_abs_diff"] > 0 and figures["yardstick_rel_l2"] > 0
    document = verify_json(source, target, "--eps", "1e-05")
    assert document["eps_source"] == "--eps"
    bare = write(tmp_path / "bare.safetensors", inputs)  # no metadata
    document = verify_json(bare, target)
    assert document["eps_source"] == "default"
    assert any("using the default 1e-05" in note for note in document["notes"])


def test_numbers_in_json_are_not_rounded(tmp_path):
    from maskln_cli.verify.job import verify_file

    inputs = batch()
    source, target = files(tmp_path, inputs, kernels.run(kernels.two_pass, inputs))
    text = invoke("verify", source, target, "--json").stdout
    figures = tensors(json.loads(text))["out"]
    exact = verify_file(str(source), str(target)).tensors[0]
    for key in ("max_abs_diff", "rel_l2", "yardstick_rel_l2", "budget_ratio"):
        assert figures[key] == getattr(exact, key), key  # every bit survives
        assert repr(getattr(exact, key)) in text
    assert len(repr(figures["rel_l2"]).split("e")[0].replace(".", "")) > 8
    truth = float64_truth(inputs)["out"]
    error = (kernels.run(kernels.two_pass, inputs)["out"].double() - truth).abs().max()
    assert figures["max_abs_diff"] == pytest.approx(float(error), rel=1e-6)


# --- the tolerance options ----------------------------------------------------------------------


def test_factor_scales_the_budget(tmp_path):
    inputs = batch(offset=1e3)
    source, target = files(tmp_path, inputs, kernels.run(kernels.one_pass, inputs))
    document = verify_json(source, target)
    needed = max(t["factor_needed"] for t in document["tensors"])
    assert not document["passed"] and needed > 3
    assert verify_json(source, target, "--factor", str(needed * 1.01))["passed"]
    assert not verify_json(source, target, "--factor", str(needed * 0.99))["passed"]


def test_rtol_and_atol_or_tolerance_fixed_give_a_fixed_tolerance(tmp_path):
    inputs = batch(offset=1e3)
    source, target = files(tmp_path, inputs, kernels.run(kernels.two_pass, inputs))
    assert verify_json(source, target)["passed"]  # the budget: a correct kernel passes
    fixed = verify_json(source, target, "--tolerance", "fixed")  # assert_close's defaults
    assert fixed["tolerance"] == "fixed" and fixed["factor"] is None and not fixed["passed"]
    loose = verify_json(source, target, "--rtol", "1e-3", "--atol", "1e-3")
    assert loose["tolerance"] == "fixed" and loose["passed"]
    tight = verify_json(source, target, "--atol", "1e-9", "--rtol", "0")
    assert not tight["passed"]
    # With --tolerance budget, --rtol and --atol are the floor that always passes.
    assert verify_json(source, target, "--tolerance", "budget", "--atol", "0")["passed"]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("--factor", "0.5"), ("--factor", ">= 1")),
        (("--factor", "nan"), ("--factor",)),
        (("--factor", "4", "--tolerance", "fixed"), ("--factor", "fixed")),
        (("--check", "out,dx"), ("--check", "'dx'", "grad_x")),
        (("--result-key", "grad_x"), ("--result-key", "NAME=KEY")),
        (("--result-key", "dx=grad_x"), ("--result-key", "'dx'")),
        (("--result-key", "out=a", "--result-key", "out=b"), ("--result-key", "twice")),
        (("--tolerance", "loose"), ("--tolerance",)),
        (("--dtype", "int8"), ("--dtype",)),
    ],
)
def test_bad_options_are_one_line_errors(tmp_path, args, fragments):
    inputs = batch()
    source, target = files(tmp_path, inputs, kernels.run(kernels.two_pass, inputs))
    result = invoke("verify", source, target, *args)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, *fragments)


def test_report_puts_the_kernels_error_beside_pytorchs(tmp_path):
    inputs = kernels.offset_batch(1e3, 0)  # 8 x 128 rows of 64, 307 of them padding
    source, target = files(tmp_path, inputs, kernels.run(kernels.torch_layer_norm, inputs))
    result = invoke("verify", source, target)
    assert result.exit_code == 0, result.stdout
    text = result.stdout
    for fragment in (
        "eps        1e-05, from metadata 'eps'",
        "rows       717 valid and 307 invalid, of 1,024",
        "as a float32 kernel: within 3x a model of float32 rounding",
        "PyTorch float32  max abs",
        "vs PyTorch       1x (max abs), 1x (rel L2) as far from float64",
        "PASS: out, grad_x, grad_scale, grad_bias within the float32 error budget",
    ):
        assert fragment in text, fragment
    assert not any(line != line.rstrip() for line in text.splitlines())  # piped: no padding


# --- what must be checked -----------------------------------------------------------------------


def test_missing_gradients_fail_by_name_and_check_limits_them(tmp_path):
    inputs = batch()
    result = kernels.run(kernels.two_pass, inputs)
    del result["grad_scale"], result["grad_bias"]
    source, target = files(tmp_path, inputs, result)
    outcome = invoke("verify", source, target)
    assert outcome.exit_code == 1
    document = verify_json(source, target)
    missing = tensors(document)["grad_scale"]
    assert not missing["passed"] and missing["shape"] is None
    assert missing["problems"][0].startswith("missing in RESULT: no key 'grad_scale'")
    assert "--check out,grad_x" in missing["problems"][0]
    assert "grad_bias" in outcome.stdout.splitlines()[-1]  # the verdict names both
    limited = verify_json(source, target, "--check", "out,grad_x")
    assert limited["passed"] and limited["checked"] == ["out", "grad_x"]


def test_gradients_under_other_names_are_never_skipped(tmp_path):
    inputs = batch()
    result = kernels.run(kernels.two_pass, inputs)
    renamed = {"y": result["out"], "dx": result["grad_x"], "dgamma": result["grad_scale"]}
    renamed["dbeta"] = result["grad_bias"]
    source, target = files(tmp_path, inputs, renamed)
    document = verify_json(source, target)
    assert not document["passed"]
    problems = {name: t["problems"][0] for name, t in tensors(document).items()}
    assert "--result-key out=y" in problems["out"]
    assert "--result-key grad_x=dx" in problems["grad_x"]
    assert "--result-key grad_scale=dgamma" in problems["grad_scale"]
    mapped = verify_json(
        source, target, "--result-key", "out=y", "--result-key", "grad_x=dx",
        "--result-key", "grad_scale=dgamma", "--result-key", "grad_bias=dbeta",
    )  # fmt: skip
    assert mapped["passed"] and mapped["notes"] == []
    # --out-key, the older spelling, still names out
    only_out = verify_json(source, target, "--out-key", "y", "--check", "out")
    assert only_out["passed"]
    notes = " | ".join(only_out["notes"])
    for key, name in (("dx", "grad_x"), ("dgamma", "grad_scale"), ("dbeta", "grad_bias")):
        assert f"'{key}' not compared (--result-key {name}={key} maps it)" in notes


def test_notes_name_every_key_not_compared_and_every_default(tmp_path):
    inputs = batch(grad=False)
    every = {**inputs, "valid": torch.ones(4, 16, dtype=torch.bool), "bias": torch.zeros(32)}
    result = kernels.run(kernels.two_pass, every)
    del inputs["valid"], inputs["bias"]
    result["grad_x"] = torch.zeros(4, 16, 32)
    result["extra"] = torch.ones(3)
    source = write(tmp_path / "in.safetensors", inputs)  # no metadata: eps is the default
    target = write(tmp_path / "result.safetensors", result)
    document = verify_json(source, target)
    notes = " | ".join(document["notes"])
    assert document["passed"] and document["checked"] == ["out"]
    for fragment in (
        "no tensor 'valid': every position is valid",
        "no tensor 'bias': using zeros",
        "'grad_x' not compared",
        "holds no 'grad_out'",
        "'extra' not compared",
        "using the default 1e-05",
    ):
        assert fragment in notes, fragment
    assert "note: " in invoke("verify", source, target).stdout
    strict = verify_json(source, target, "--strict")
    assert not strict["passed"]
    assert {t["name"] for t in strict["tensors"] if not t["passed"]} == {"grad_x", "extra"}


def test_check_of_gradients_needs_an_upstream_gradient(tmp_path):
    inputs = batch(grad=False)
    source, target = files(tmp_path, inputs, kernels.run(kernels.two_pass, inputs))
    result = invoke("verify", source, target, "--check", "out,grad_x")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "--check grad_x", "grad_out")


# --- the padding --------------------------------------------------------------------------------


def test_nonzero_padding_fails_and_says_so(tmp_path):
    inputs = batch()
    result = kernels.run(kernels.two_pass, inputs)
    valid = inputs["valid"]
    result["out"][~valid] = 1e-8  # within any tolerance, but padding leaks
    source, target = files(tmp_path, inputs, result)
    out = tensors(verify_json(source, target))["out"]
    invalid = int((~valid).sum())
    assert not out["passed"] and out["invalid_rows_zero"] is False
    assert out["problems"] == [f"only the {invalid:,} invalid rows differ: padding not zeroed"]
    assert out["mismatched_invalid_rows"] == invalid
    # The budget figure covers the valid rows only: it must not read as the failure's size.
    block = invoke("verify", source, target).stdout.split("FAIL out", 1)[1].split("\n\n", 1)[0]
    assert "worst valid element" in block and "worst element" not in block


def test_negative_zero_in_the_padding_is_reported_and_fails_under_strict(tmp_path):
    inputs = batch()
    result = kernels.zero_padding(kernels.run(kernels.two_pass, inputs), inputs["valid"])
    valid = inputs["valid"]
    result["out"][~valid] = -0.0
    source, target = files(tmp_path, inputs, result)
    padded = int((~valid).sum()) * 32
    document = verify_json(source, target)
    out = tensors(document)["out"]
    assert document["passed"] and out["negative_zeros"] == padded
    assert tensors(document)["grad_x"]["negative_zeros"] == 0
    assert f"-0.0 at {padded:,} padded positions" in invoke("verify", source, target).stdout
    strict = tensors(verify_json(source, target, "--strict"))["out"]
    assert not strict["passed"]
    assert strict["problems"] == [f"-0.0 at {padded:,} padded positions (+0.0 expected; --strict)"]


def test_maskln_writes_positive_zero_gradients_in_the_padding(tmp_path):
    inputs = kernels.offset_batch(0.0, 1, shape=(2, 4, 8))  # a small case, poisoned padding
    source = write(tmp_path / "in.safetensors", inputs)
    output = tmp_path / "out.safetensors"
    assert invoke("normalize", source, output).exit_code == 0
    written, invalid = read(output), ~inputs["valid"]
    for key in ("out", "grad_x"):
        assert bool((written[key][invalid] == 0).all()), key
        assert not bool(written[key][invalid].signbit().any()), key
    leaves = [inputs[k].clone().requires_grad_() for k in ("x", "scale", "bias")]
    out = masked_layer_normalization(leaves[0], inputs["valid"], *leaves[1:])
    (grad_x,) = torch.autograd.grad(out, leaves[0], -inputs["grad_out"].abs())
    assert not bool(grad_x[invalid].signbit().any())
    assert verify_json(source, output, "--strict")["passed"]


# --- what is wrong, in words --------------------------------------------------------------------


def test_nan_gradients_are_said_in_words_and_diagnosed(tmp_path):
    inputs = kernels.offset_batch(0.0, 0)
    source, target = files(tmp_path, inputs, kernels.run(kernels.nan_leak, inputs))
    document = verify_json(source, target)
    figures = tensors(document)
    assert figures["out"]["passed"] and figures["grad_bias"]["passed"]
    scale = figures["grad_scale"]
    assert scale["problems"] == ["NaN where the reference is finite at 64 of 64 elements"]
    assert [d["mistake"] for d in scale["diagnosis"]] == ["nan_from_padding"]
    grad_x = figures["grad_x"]
    assert grad_x["problems"] == [
        "NaN where the reference is finite at 19,648 of 65,536 elements, all in the 307"
        " invalid rows: padding not zeroed"
    ]
    text = invoke("verify", source, target).stdout
    assert "finite elements only: 64 are NaN or inf" in text
    assert "abs diff inf" not in text and "not finite" in text


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int32, torch.bool])
def test_a_result_that_is_not_floating_point_fails(tmp_path, dtype):
    inputs = batch(grad=False)
    out = kernels.run(kernels.two_pass, inputs)["out"]
    source, target = files(tmp_path, inputs, {"out": out.to(dtype)})
    figures = tensors(verify_json(source, target))["out"]
    name = str(dtype).removeprefix("torch.")
    assert not figures["passed"]
    assert figures["problems"] == [
        f"dtype {name}: not a floating-point result; values not compared"
    ]


def test_same_size_in_another_shape_is_said_not_compared(tmp_path):
    inputs = batch(grad=False)
    out = kernels.run(kernels.two_pass, inputs)["out"]
    source, target = files(tmp_path, inputs, {"out": out.transpose(1, 2).contiguous()})
    figures = tensors(verify_json(source, target))["out"]
    assert figures["problems"] == [
        "shape [4, 32, 16] vs expected [4, 16, 32]: the same number of elements in another"
        " shape; values not compared"
    ]
    assert figures["mismatched"] is None


def test_worst_rows_show_the_max_abs_element_even_within_its_budget(tmp_path):
    # Sequence 0 carries an offset of 1e3: a correct float32 kernel errs most there, within
    # its (large) budget. One row without offset is wrong by 5e-5: the only failure.
    inputs = batch(grad=False)
    valid = inputs["valid"]
    inputs["x"][0] = torch.where(valid[0][..., None], inputs["x"][0] + 1e3, inputs["x"][0])
    result = kernels.run(kernels.two_pass, inputs)
    wrong = tuple(valid[1].nonzero()[0].tolist())
    result["out"][1][wrong][3] += 5e-5
    source, target = files(tmp_path, inputs, result)
    figures = tensors(verify_json(source, target))["out"]
    assert not figures["passed"] and figures["mismatched"] == 1
    first, last = figures["worst"][0], figures["worst"][-1]
    assert first["index"] == [1, *wrong, 3] and first["abs_diff"] > first["allowed"]
    assert last["index"] == figures["max_abs_index"] and last["index"][0] == 0
    assert last["abs_diff"] <= last["allowed"]
    text = invoke("verify", source, target).stdout
    assert "max abs diff, within its budget" in text


# --- errors and streams -------------------------------------------------------------------------


def test_uses_normalize_options(tmp_path):
    inputs = batch(grad=False)
    result = kernels.run(kernels.two_pass, inputs)
    source = write(tmp_path / "in.safetensors", {"acts": inputs["x"], "valid": inputs["valid"]})
    checkpoint = write(
        tmp_path / "ckpt.safetensors", {"ln.weight": inputs["scale"], "ln.bias": inputs["bias"]}
    )
    target = write(tmp_path / "kernel.safetensors", result)
    args = ["--x-key", "acts", "--params", checkpoint, "--scale-key", "ln.weight"]
    args += ["--bias-key", "ln.bias"]
    assert invoke("verify", source, target, *args).exit_code == 0
    assert invoke("verify", source, target, *args, "--eps", "0.5").exit_code == 1


def test_result_from_stdin():
    result = run("verify", PAIRS, "-", input=EXPECTED_PAIRS.read_bytes())
    assert result.returncode == 0 and b"PASS" in result.stdout


def test_errors_exit_2(tmp_path):
    result = invoke("verify", tmp_path / "nope.safetensors", EXPECTED_PAIRS)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "nope.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x01" * 100)
    result = invoke("verify", PAIRS, garbage)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "garbage.safetensors", "not a valid safetensors file")
    result = invoke("verify", "-", "-")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "both be '-'")


def test_chunked_verify_equals_whole():
    whole = json.loads(invoke("verify", PAIRS, EXPECTED_PAIRS, "--json").stdout)
    chunked = json.loads(
        invoke("verify", PAIRS, EXPECTED_PAIRS, "--json", "--chunk-rows", "700").stdout
    )
    for a, b in zip(whole["tensors"], chunked["tensors"], strict=True):
        # Row by row, every figure is the same whatever the chunks; sums over rows (rel_l2,
        # grad_scale and grad_bias) may differ in their last bits, and PyTorch's grad_scale and
        # grad_bias, summed a chunk at a time, by its own rounding (so the budgets derived).
        sums = a["name"] in ("grad_scale", "grad_bias")
        for key, value in a.items():
            if sums and key.startswith(("yardstick", "budget_ratio", "factor_needed")):
                continue
            if isinstance(value, float) and (sums or "l2" in key):
                assert b[key] == pytest.approx(value, rel=1e-6), key
            elif key == "row_rel_error" and value is not None:
                assert b[key]["rows"] == value["rows"]
                assert b[key]["mean"] == pytest.approx(value["mean"], rel=1e-9)
            else:
                assert b[key] == value, key


def test_worked_example_against_its_expected_file():
    expected = WORKED.with_name("worked_example_expected.safetensors")
    document = verify_json(WORKED, expected)
    assert document["passed"] and document["eps"] == 3.0 and document["result_dtype"] == "float64"


def test_pytorchs_own_one_liner_on_clean_padding_is_exactly_its_yardstick(tmp_path):
    inputs = batch(offset=1e4, grad=False)
    clean = torch.where(inputs["valid"][..., None], inputs["x"], 0.0)
    out = F.layer_norm(clean, (32,), inputs["scale"], inputs["bias"], 1e-5)
    source, target = files(
        tmp_path, inputs, {"out": out.masked_fill(~inputs["valid"][..., None], 0)}
    )
    figures = tensors(verify_json(source, target))["out"]
    assert figures["passed"] and figures["max_abs_diff"] == figures["yardstick_max_abs_diff"]
    assert figures["max_abs_diff"] > 1e-4  # float32 at an offset of 1e4: far from float64
