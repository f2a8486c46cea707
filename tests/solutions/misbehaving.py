"""Solutions that misbehave rather than compute wrongly: they hang, crash, raise, allocate
without bound, or try to fool the grader. Graded in a child process, each fails the clauses
it misbehaves in, with the reason, and the grader finishes with its report."""

import ctypes
import os
import time

import torch

from tests.solutions.correct import masked_layer_normalization as correct


def starter_code(x, valid, scale, bias, eps=1e-05):
    """The specification's starter code, unchanged: every call raises."""
    raise NotImplementedError("Implement masked_layer_normalization")


def hangs_on_wide_rows(x, valid, scale, bias, eps=1e-05):
    """Loops forever when C is 24 (the dtypes clause's rows); correct otherwise."""
    if x.shape[-1] == 24:
        while True:
            time.sleep(0.01)
    return correct(x, valid, scale, bias, eps)


def crashes(x, valid, scale, bias, eps=1e-05):
    """Dereferences a null pointer (as a broken C extension does) on 2 channels, and ends the
    process skipping every handler, os._exit(3), otherwise."""
    if x.shape[-1] == 2:
        ctypes.string_at(0)
    os._exit(3)


def allocates_too_much(x, valid, scale, bias, eps=1e-05):
    """Asks for a 2 GiB workspace per call."""
    workspace = torch.empty(1 << 29, dtype=torch.float32)
    del workspace
    return correct(x, valid, scale, bias, eps)


def fools_comparisons(x, valid, scale, bias, eps=1e-05):
    """Wrong values (bias never added), and every torch comparison patched to say "equal":
    the grader compares in its own process, so this changes nothing."""
    torch.equal = lambda *args, **kwargs: True
    torch.allclose = lambda *args, **kwargs: True
    torch.testing.assert_close = lambda *args, **kwargs: None
    torch.Tensor.__eq__ = lambda self, other: torch.ones_like(self, dtype=torch.bool)
    return correct(x, valid, scale, torch.zeros_like(bias), eps)


def hangs(x, valid, scale, bias, eps=1e-05):
    """Never returns (benchmarks/grade_wall_time.py times the grader on it)."""
    while True:
        time.sleep(0.01)


def memory_bomb(x, valid, scale, bias, eps=1e-05):
    """Allocates without bound, and retries when an allocation fails (as a caching allocator
    does): it never raises, it runs out of time at the memory cap."""
    hoard = []
    while True:
        try:
            hoard.append(torch.ones(1 << 26, dtype=torch.uint8))  # 64 MiB, touched
        except (MemoryError, RuntimeError):
            time.sleep(0.01)


def prints_too_much(x, valid, scale, bias, eps=1e-05):
    """Prints without end: past the grader's output cap, its write fails."""
    line = "x" * (1 << 20)
    while True:
        print(line)
