"""verify with gradients: each block's budget statistics are made once and shared by out, grad_x
and the gradient sums, and the yardstick's gradients come from torch's layer-norm kernels called
directly (no autograd). Both are speed-ups only: every figure must be the same, bit for bit, as
making each afresh, on poisoned padding, all-invalid rows and one channel alike."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from maskln_cli.verify.blockwork import BlockWork
from maskln_cli.verify.budget import Precision, RowBudget
from maskln_cli.verify.job import verify_file
from maskln_cli.verify.yardstick import yardstick
from tests import kernels
from tests.clitools import write


def poisoned(shape=(2, 300, 16)):
    return kernels.offset_batch(3.0, 1, shape=shape)  # NaN and inf in the padding


def all_invalid():
    inputs = poisoned()
    return dict(inputs, valid=torch.zeros_like(inputs["valid"]))


CASES = {
    "poisoned padding": poisoned,
    "all invalid": all_invalid,
    "one channel": lambda: poisoned((3, 200, 1)),
}


def rows_of(inputs):
    channels = inputs["x"].shape[-1]
    return (
        inputs["x"].reshape(-1, channels),
        inputs["valid"].reshape(-1),
        inputs["grad_out"].reshape(-1, channels),
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t`` (NaN payloads and -0.0 included)."""
    return t.contiguous().view(
        {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def autograd_yardstick(x, valid, scale, bias, dtype, grad_out):
    """The yardstick as autograd computes it: F.layer_norm of the padding zeroed, its output's
    padding zeroed, and torch.autograd.grad."""
    keep, zero = valid.unsqueeze(1), torch.zeros((), dtype=dtype)
    leaves = [
        t.detach().requires_grad_()
        for t in (torch.where(keep, x.to(dtype), zero), scale.to(dtype), bias.to(dtype))
    ]
    out = torch.where(keep, F.layer_norm(leaves[0], (x.shape[-1],), *leaves[1:], 1e-5), zero)
    upstream = torch.where(keep, grad_out.to(dtype), zero)
    return (out.detach(), *torch.autograd.grad(out, leaves, upstream))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_yardsticks_gradients_are_autograds_bit_for_bit(case, dtype):
    inputs = CASES[case]()
    x, valid, grad_out = rows_of(inputs)
    scale, bias = inputs["scale"].double(), inputs["bias"].double()
    ours = yardstick(x, valid, scale, bias, 1e-5, dtype, grad_out)
    expected = autograd_yardstick(x, valid, scale, bias, dtype, grad_out)
    got = (ours.out, ours.grad_x, ours.grad_scale, ours.grad_bias)
    for name, a, b in zip(("out", "grad_x", "grad_scale", "grad_bias"), got, expected, strict=True):
        assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), name


@pytest.mark.parametrize("case", CASES)
def test_a_blocks_budget_gives_its_rows_budget_bit_for_bit(case):
    inputs = CASES[case]()
    x, valid, grad_out = (t.double() if t.is_floating_point() else t for t in rows_of(inputs))
    scale, bias = inputs["scale"].double(), inputs["bias"].double()
    block = RowBudget(x, valid, scale, bias, 1e-5, Precision.of(torch.float32))
    picked = torch.tensor([0, 5, 7, x.shape[0] - 1])  # valid rows and poisoned padding
    for judged in (torch.float32, torch.bfloat16):
        precision = Precision.of(judged, torch.float32, torch.float32, torch.float32)
        afresh = RowBudget(x[picked], valid[picked], scale, bias, 1e-5, precision)
        shared = block.rows(picked).judged_in(precision)
        assert torch.equal(bits(shared.out()), bits(afresh.out()))
        assert torch.equal(
            bits(shared.grad_x(grad_out[picked])), bits(afresh.grad_x(grad_out[picked]))
        )
        whole = RowBudget(x, valid, scale, bias, 1e-5, precision).share_of_sums(grad_out)
        share = block.judged_in(precision).share_of_sums(grad_out)
        assert share.rows == whole.rows
        for name in ("scale_squares", "bias_squares", "moved_squares"):
            assert torch.equal(bits(getattr(share, name)), bits(getattr(whole, name))), name


@pytest.mark.parametrize("case", CASES)
def test_verify_with_gradients_reports_what_the_general_path_does(case, tmp_path, monkeypatch):
    """The blocked path (shared statistics) against the general path, which makes its chunk's
    budget from x itself: one chunk of one block here, so even the sums are the same bits (on
    one torch thread: the general path's yardstick would split its sums over rows between
    threads, and round them differently)."""
    inputs = CASES[case]()
    source = write(tmp_path / "in.safetensors", inputs, eps="1e-05")
    # A correct float32 kernel of its own (not the yardstick): every figure is non-trivial.
    computed = kernels.zero_padding(kernels.run(kernels.sequential, inputs), inputs["valid"])
    result = write(tmp_path / "res.safetensors", computed)

    def report():
        tensors = verify_file(str(source), str(result)).tensors
        return [repr(dataclasses.asdict(t)) for t in tensors if t.name != "out"]

    blocked = []
    measure = BlockWork.measure
    monkeypatch.setattr(BlockWork, "measure", lambda *a: blocked.append(measure(*a)) or blocked[-1])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fast = report()
        assert blocked and all(b is not None for b in blocked)  # the blocked path was taken
        monkeypatch.setattr(BlockWork, "measure", lambda *a: None)  # every chunk compared whole
        assert fast == report()
    finally:
        torch.set_num_threads(threads)
