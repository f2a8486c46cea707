"""What kind of wrong `maskln verify` says (issue 23, items 2-4) and verdicts that compare
nothing or judge in a lower precision (issue 25, items 9 and 10)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from maskln_cli.jobs.generate import generate_inputs
from tests.clitools import assert_one_line_error, invoke, write

SHAPE = (4, 64, 128)


def inputs(seed=3, grad=False, std=1.0):
    return generate_inputs(SHAPE, "float32", seed, invalid=0.3, poison=True, grad=grad, std=std)


def plain(t, eps=1e-5, dtype=torch.float32):
    """A model's nn.LayerNorm: every row normalized, padding too (poison replaced by 0)."""
    x = torch.nan_to_num(t["x"], nan=0.0, posinf=0.0, neginf=0.0).to(dtype)
    return F.layer_norm(x, (SHAPE[-1],), t["scale"].to(dtype), t["bias"].to(dtype), eps)


def masked(t, eps=1e-5, dtype=torch.float32):
    keep = t["valid"][..., None]
    return torch.where(keep, plain(t, eps, dtype), torch.zeros((), dtype=dtype))


def verify(tmp_path, t, result, *args, **metadata):
    source = write(tmp_path / "in.safetensors", t, **metadata)
    target = write(tmp_path / "result.safetensors", result)
    done = invoke("verify", source, target, "--json", *args)
    assert done.exit_code in (0, 1), done.stderr
    document = json.loads(done.stdout)
    return done, document, {tensor["name"]: tensor for tensor in document["tensors"]}


def test_the_eps_result_used_is_found_and_named_with_the_option_to_give(tmp_path):
    """A kernel with eps 1e-3 judged against the default 1e-5: the rows give it back. Before:
    'a formula or eps mistake', no eps."""
    t = inputs(std=0.1)  # var 1e-2: eps 1e-3 moves every row by 5 %
    _, document, tensors = verify(tmp_path, t, {"out": masked(t, eps=1e-3)})
    out = tensors["out"]
    assert not document["passed"]
    assert out["systematic"]["eps"] == pytest.approx(1e-3, rel=1e-3)
    valid = int(t["valid"].sum())
    assert out["problems"][0] == (
        f"all {valid:,} valid rows off; relative error 0.047 ± 0.006, uniform: RESULT's eps ≈"
        " 0.001, not the reference's 1e-05 (the default): give the model's eps: `--eps 0.001`"
        " (or `--config`)"
    )
    # One explanation: the diagnosis is the eps found, not the catalogue's "eps missing".
    assert [d["mistake"] for d in out["diagnosis"]] == ["eps_mismatch"]
    _, document, _ = verify(tmp_path, t, {"out": masked(t, eps=1e-3)}, "--eps", "1e-3")
    assert document["passed"]
    # An eps the file gives (a dump's: the model's) is more likely right than the kernel's.
    _, document, tensors = verify(tmp_path, t, {"out": masked(t, eps=1e-3)}, eps="1e-05")
    assert tensors["out"]["problems"][0].endswith(
        "uniform: RESULT's eps ≈ 0.001, not the reference's 1e-05 (from metadata 'eps'): give"
        " `--eps 0.001`"
    )
    assert tensors["out"]["diagnosis"][0]["fix"] == (
        "if RESULT's eps is the right one, give `--eps 0.001`; else the kernel's eps is not the"
        " model's"
    )


def test_a_bert_eps_on_a_models_output_is_found_and_the_padding_never_blamed(tmp_path):
    """BERT's eps 1e-12 against the default, on a model's own output (padding normalized),
    its valid rows compared: systematic; RESULT's eps is too small to resolve from rows of
    variance 1, so it is bounded, and said instead of the catalogue's 'eps missing'. The
    padding is not blamed (before: 'invalid rows are normalized like valid ones')."""
    t = inputs()
    _, document, tensors = verify(tmp_path, t, {"out": plain(t, eps=1e-12)}, "--plain-layer-norm")
    out = tensors["out"]
    assert not document["passed"]
    assert out["systematic"]["eps_at_most"] < 1e-5
    assert "RESULT's eps is at most" in out["problems"][0]
    assert "give the model's eps: `--eps EPS` (or `--config`)" in out["problems"][0]
    assert not any("invalid" in p or "padding" in p for p in out["problems"])
    _, document, _ = verify(tmp_path, t, {"out": plain(t, eps=1e-12)}, "--plain-layer-norm",
                            "--eps", "1e-12")  # fmt: skip
    assert document["passed"]


def test_a_models_own_output_is_recognized_and_the_option_named(tmp_path):
    t = inputs(grad=True)
    x = torch.nan_to_num(t["x"], nan=0.0, posinf=0.0, neginf=0.0).requires_grad_()
    scale, bias = (t[k].clone().requires_grad_() for k in ("scale", "bias"))
    out = F.layer_norm(x, (SHAPE[-1],), scale, bias, 1e-5)
    grads = torch.autograd.grad(out, (x, scale, bias), t["grad_out"].nan_to_num(0.0))
    t["x"], t["grad_out"] = x.detach(), t["grad_out"].nan_to_num(0.0)
    result = dict(zip(("out", "grad_x", "grad_scale", "grad_bias"), (out, *grads), strict=True))
    result = {k: v.detach() for k, v in result.items()}
    _, document, tensors = verify(tmp_path, t, result)
    assert not document["passed"]
    assert "a plain LayerNorm of x" in tensors["out"]["problems"][0]
    assert "--plain-layer-norm compares the valid rows only" in tensors["out"]["problems"][0]
    _, document, tensors = verify(tmp_path, t, result, "--plain-layer-norm")
    assert document["passed"], [t["problems"] for t in tensors.values()]
    assert document["valid_rows"] == int(t["valid"].sum())


def test_a_mask_under_another_name_is_suggested(tmp_path):
    t = inputs()
    t["attention_mask"] = t.pop("valid").long()  # transformers' int64 0/1
    _, document, _ = verify(tmp_path, t, {"out": plain(t)})
    assert any("did you mean `--valid-key attention_mask`?" in n for n in document["notes"])


def test_float32_values_stored_as_float64_are_said_in_the_verdict_line(tmp_path):
    t = inputs()
    source = write(tmp_path / "in.safetensors", t)
    target = write(tmp_path / "result.safetensors", {"out": masked(t).double()})
    done = invoke("verify", source, target, "-q")
    assert done.exit_code == 1
    assert "out: every value is exactly a float32, stored as float64" in done.stdout
    assert "--dtype float32 judges it as one" in done.stdout
    assert invoke("verify", source, target, "-q", "--dtype", "float32").exit_code == 0


def test_a_wrong_module_is_named(tmp_path):
    t = inputs()
    g = torch.Generator().manual_seed(5)
    params = {}
    for layer in range(3):
        module = f"encoder.layer.{layer}.output.LayerNorm"
        params[f"{module}.weight"] = 1 + 0.3 * torch.randn(SHAPE[-1], generator=g)
        params[f"{module}.bias"] = 0.3 * torch.randn(SHAPE[-1], generator=g)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    write(checkpoint / "model.safetensors", params)
    right = "encoder.layer.2.output.LayerNorm"
    used = dict(t, scale=params[f"{right}.weight"], bias=params[f"{right}.bias"])
    result = {"out": masked(used)}
    del t["scale"], t["bias"]
    wrong = "encoder.layer.1.output.LayerNorm"
    args = ("--params", str(checkpoint), "--module", wrong)
    _, document, tensors = verify(tmp_path, t, result, *args)
    assert not document["passed"]
    assert tensors["out"]["problems"][0] == (
        f"RESULT matches the reference computed with the weights of {right!r}, not"
        f" {wrong!r}: --module {right}?"
    )
    _, document, _ = verify(tmp_path, t, result, "--params", str(checkpoint), "--module", right)
    assert document["passed"]


def test_a_mask_that_leaves_out_every_row_compares_nothing_and_is_an_error(tmp_path):
    t = inputs()
    source = write(tmp_path / "in.safetensors", t)
    target = write(tmp_path / "result.safetensors", {"out": masked(t) * 2})  # wrong
    mask = write(tmp_path / "mask.safetensors", {"keep": torch.zeros(SHAPE[:-1], dtype=bool)})
    done = invoke("verify", source, target, "--valid", f"{mask}:keep", "--check", "out")
    assert done.exit_code == 2
    assert_one_line_error(done.stderr, "leaves out every one of its 256 rows", "out")


def test_a_lower_precision_is_said_and_each_tensor_judged_in_its_own_dtype(tmp_path):
    """float16 out beside float32 grad_scale and grad_bias computed in float16: the gradients
    are judged by float32's budget, and fail (before: all by float16's, and passed)."""
    t = inputs(grad=True)
    keep = t["valid"][..., None]
    x = torch.where(keep, t["x"], 0.0).half().requires_grad_()
    scale, bias = t["scale"].half().requires_grad_(), t["bias"].half().requires_grad_()
    out = F.layer_norm(x, (SHAPE[-1],), scale, bias, 1e-5)
    grad_out = torch.where(keep, t["grad_out"], 0.0).half()
    grad_x, grad_scale, grad_bias = torch.autograd.grad(out, (x, scale, bias), grad_out)
    zero = torch.zeros((), dtype=torch.float16)
    result = {
        "out": torch.where(keep, out.detach(), zero),
        "grad_x": torch.where(keep, grad_x, zero),
    }
    halves = {**result, "grad_scale": grad_scale, "grad_bias": grad_bias}
    _, document, tensors = verify(tmp_path, t, halves, eps="1e-05")
    assert document["passed"]
    lower = {"x_dtype": "float32", "tensors": dict.fromkeys(tensors, "float16")}
    assert document["lower_precision"] == lower
    shown = invoke("verify", tmp_path / "in.safetensors", tmp_path / "result.safetensors", "-q")
    assert shown.stdout.strip().endswith(
        "are float16, a lower precision than x (float32): judged by float16's budget"
        " (--dtype float32 judges by float32's)"
    )
    wide = {**result, "grad_scale": grad_scale.float(), "grad_bias": grad_bias.float()}
    _, document, tensors = verify(tmp_path, t, wide, eps="1e-05")
    assert not document["passed"]
    assert not tensors["grad_scale"]["passed"] and not tensors["grad_bias"]["passed"]
    assert tensors["out"]["passed"] and tensors["grad_x"]["passed"]
    assert (
        "every value is exactly a float16, stored as float32"
        in (tensors["grad_scale"]["problems"][0])
    )
    assert document["lower_precision"]["tensors"] == {"out": "float16", "grad_x": "float16"}


def test_rows_left_out_by_plain_layer_norm_are_not_said_to_be_valids(tmp_path):
    """The report said 'left out N rows (--valid)' under --plain-layer-norm alone."""
    t = inputs()
    source = write(tmp_path / "in.safetensors", t)
    target = write(tmp_path / "result.safetensors", {"out": plain(t)})
    left_out = int((~t["valid"]).sum())
    done = invoke("verify", source, target, "--plain-layer-norm")
    assert done.exit_code == 0, done.stdout
    assert f"left out         {left_out} rows (--plain-layer-norm: INPUT's invalid rows)" in (
        done.stdout
    )
    assert "(--valid)" not in done.stdout
