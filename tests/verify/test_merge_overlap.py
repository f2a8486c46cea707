"""verify merges one group of chunks while the next group's blocks are measured
(measure.StreamingPass.run): the calling thread's merging (the running figures, the fits'
and sums' bookkeeping, the poisoned rows) ran while both workers waited for it, and each group
ended with the workers waiting for its slowest block. The figures are the same bits (merged in
the same order): only which rows a block judges may depend on the ratio merged so far."""

from __future__ import annotations

import threading

import pytest
import torch

from maskln_cli import testing
from maskln_cli.verify import blockwork, measure
from tests import kernels
from tests.threadtools import openmp


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _case(grad: bool):
    data = kernels.offset_batch(0.0, 3, (96, 64, 64))  # 6,144 rows of 64: many blocks
    result = kernels.zero_padding(kernels.run(kernels.torch_layer_norm, data), data["valid"])
    extra = {}
    if grad:
        extra = {k: result[k] for k in ("grad_x", "grad_scale", "grad_bias")}
        extra["grad_out"] = data["grad_out"]
    return result["out"], data, extra


def _report(grad: bool) -> dict:
    out, data, extra = _case(grad)
    report = testing.verify(
        out, data["x"], data["valid"], data["scale"], data["bias"], kernels.EPS, **extra
    )
    return report.to_dict()


@openmp
def test_a_group_is_merged_while_the_next_groups_blocks_are_measured(two_threads, monkeypatch):
    """Groups of two chunks of two blocks: the merge of the second group's first chunk waits
    (up to 10 s) for a block of the third group to start; before, that block was only queued
    once the merge was done."""
    monkeypatch.setattr(measure, "CHUNK_ELEMENTS", 512 * 64)
    monkeypatch.setattr(measure, "GROUP_ELEMENTS", 2 * 512 * 64)
    monkeypatch.setattr("maskln_cli.compare.comparison.BLOCK_ELEMENTS", 256 * 64)
    later_block = threading.Event()
    merged_after: list[bool] = []
    measure_block = blockwork.BlockWork.measure
    merge_chunk = measure.StreamingPass._merge_chunk

    def measuring(self, start, stop):
        if start >= 3 * 512:  # a block of the third group (chunks of 512 rows)
            later_block.set()
        return measure_block(self, start, stop)

    def merging(self, start, stop, *args):
        if start == 512:  # the second group's first chunk
            merged_after.append(later_block.wait(timeout=10))
        return merge_chunk(self, start, stop, *args)

    monkeypatch.setattr(blockwork.BlockWork, "measure", measuring)
    monkeypatch.setattr(measure.StreamingPass, "_merge_chunk", merging)
    _report(grad=True)
    assert merged_after == [True]


@pytest.mark.parametrize("grad", [False, True])
def test_figures_do_not_depend_on_the_groups(grad, monkeypatch):
    """The same report, bit for bit, with one group for all chunks and with groups of two."""
    monkeypatch.setattr(measure, "CHUNK_ELEMENTS", 512 * 64)
    monkeypatch.setattr(measure, "GROUP_ELEMENTS", 1 << 30)
    whole = _report(grad)
    monkeypatch.setattr(measure, "GROUP_ELEMENTS", 2 * 512 * 64)
    assert _report(grad) == whole


@pytest.mark.parametrize("grad", [False, True])
def test_poisoned_rows_are_those_with_nan_or_inf_in_x_or_grad_out(grad):
    """The padding rows remembered for a NaN gradient's diagnosis: rows holding NaN or inf in
    x, or (with gradients) in grad_out; not a row whose finite values' float32 sum overflows."""
    from types import SimpleNamespace

    x, grad_out = torch.randn(12, 8), torch.randn(12, 8)
    valid = torch.tensor([True, False] * 6)
    x[1, 3], x[5, 0] = torch.nan, -torch.inf
    x[3] = 3e38  # finite, its sum inf
    x[2, 2] = torch.nan  # a valid row: not looked at
    grad_out[7, 7] = torch.inf
    grad_out[9] = -3e38
    state = SimpleNamespace(poisoned=[])
    measure.StreamingPass._note_poison(state, 100, x, valid, grad_out if grad else None)
    assert state.poisoned == ([101, 105, 107] if grad else [101, 105])
