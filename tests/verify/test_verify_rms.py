"""``maskln verify`` on RMSNorm problems (issue 39): correct RMSNorm kernels pass in four dtypes
on hard rows, wrong ones fail with their own cause named (RMSNorm's catalogue) or none, never
another's (a LayerNorm cause included)."""

from __future__ import annotations

import json

import pytest
import torch

from maskln_cli.verify.job import verify_file
from tests.clitools import invoke, write
from tests.verify.test_rms_budget import CORRECT, DTYPES, WRONG, hard_rows, kernel
from tests.verify.test_rms_diagnosis import CAUSES

EPS = 1e-6


def problem_files(tmp_path, kind, dtype, channels=64, leak=False):
    """An RMSNorm problem file (metadata norm=rms) and a kernel's RESULT file for it."""
    x64, valid = hard_rows(dtype, channels)
    generator = torch.Generator().manual_seed(1)
    weight = (1 + 0.5 * torch.randn(channels, generator=generator, dtype=torch.float64)).to(dtype)
    dy = torch.randn(x64.shape, generator=generator, dtype=torch.float64).to(dtype)
    x = x64.to(dtype)
    source = write(
        tmp_path / "in.safetensors",
        {"x": x, "valid": valid, "scale": weight, "grad_out": dy},
        norm="rms", eps=repr(EPS),
    )  # fmt: skip
    out, grad_x, grad_scale = kernel(kind)(x, valid, weight, EPS, dy)
    if leak:  # padding not zeroed: a value where +0.0 belongs
        out = torch.where(valid[:, None], out, torch.ones((), dtype=dtype))
    result = write(
        tmp_path / "result.safetensors", {"out": out, "grad_x": grad_x, "grad_scale": grad_scale}
    )
    return source, result


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", CORRECT)
def test_correct_rms_kernels_pass(tmp_path, kind, dtype):
    source, result = problem_files(tmp_path, kind, dtype)
    report = verify_file(str(source), str(result))
    assert report.passed, [t.problems for t in report.tensors]
    assert [t.name for t in report.tensors] == ["out", "grad_x", "grad_scale"]
    assert report.context["yardstick"].startswith("torch.nn.functional.rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", WRONG)
def test_wrong_rms_kernels_fail_with_their_own_cause_or_none(tmp_path, kind, dtype):
    if kind == "half accumulation" and dtype in (torch.float32, torch.float64):
        pytest.skip("accumulating in float32 or float64 is not a mistake")
    channels = 8 if kind == "variance over C-1" else 1024
    source, result = problem_files(tmp_path, kind, dtype, channels)
    report = verify_file(str(source), str(result))
    assert not report.passed
    for tensor in report.tensors:
        named = [d["mistake"] for d in tensor.diagnosis]
        assert named in ([], [CAUSES[kind]]), (tensor.name, named)


def test_padding_that_leaks_fails_on_the_padding(tmp_path):
    source, result = problem_files(tmp_path, "pairwise float32", torch.float32, leak=True)
    report = verify_file(str(source), str(result))
    out = next(t for t in report.tensors if t.name == "out")
    assert not out.passed and out.invalid_rows_zero is False
    assert not out.diagnosis


def test_the_command_says_rms_norm_and_judges_no_grad_bias(tmp_path):
    source, result = problem_files(tmp_path, "two-pass scaled", torch.bfloat16)
    human = invoke("verify", source, result)
    assert human.exit_code == 0, human.stdout + human.stderr
    assert "F.rms_norm in bfloat16" in human.stdout
    document = json.loads(invoke("verify", source, result, "--json").stdout)
    assert document["passed"] is True
    assert {t["name"] for t in document["tensors"]} == {"out", "grad_x", "grad_scale"}
    wrong = problem_files(tmp_path, "1 + scale", torch.float32)
    failed = invoke("verify", *wrong)
    assert failed.exit_code == 1
    assert "FAIL: 2 of 3 tensors: out and grad_x: the gain is one more than due" in failed.stdout


def test_rows_whose_squares_overflow_float32_get_no_budget_from_f_rms_norm(tmp_path):
    """F.rms_norm in float32 overflows on rows above 1.8e19 (its output is 0 there): as a
    yardstick it would raise those rows' budget to an error of 1. The model alone is RMSNorm's
    budget: maskln's own op passes there, and an op off by 5% at random fails."""
    from maskln_cli import masked_rms_normalization

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(6, 128, generator=generator) * 1e25
    valid = torch.tensor([True, True, True, True, True, False])
    weight = 1 + 0.3 * torch.randn(128, generator=generator)
    dy = torch.randn(6, 128, generator=generator)
    source = write(tmp_path / "in.safetensors", {"x": x, "valid": valid, "scale": weight,
                                                 "grad_out": dy}, norm="rms")  # fmt: skip
    leaves = (x.clone().requires_grad_(), weight.clone().requires_grad_())
    out = masked_rms_normalization(leaves[0], valid, leaves[1], 1e-6)
    grad_x, grad_scale = torch.autograd.grad(out, leaves, dy)
    right = {"out": out.detach(), "grad_x": grad_x, "grad_scale": grad_scale}
    assert verify_file(str(source), str(write(tmp_path / "right.safetensors", right))).passed
    noise = 1 + 0.05 * torch.randn(out.shape, generator=generator)
    wrong = dict(right, out=out.detach() * noise)
    report = verify_file(str(source), str(write(tmp_path / "wrong.safetensors", wrong)))
    assert not report.passed and not report.tensors[0].passed
