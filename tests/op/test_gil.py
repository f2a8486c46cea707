"""Other Python threads run while the op computes (a data loader's, a server's): the kernels do
not hold Python's lock. A thread that counts, yielding the lock at each count, must go on
counting while a long call is under way; with the lock held for the call it gets at most a few
counts in (at the op's Python entry, before the kernel starts).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from maskln_cli import masked_layer_normalization

ROWS, CHANNELS = 8192, 2048  # 128 MiB of float64: a call of a tenth of a second or so
ENOUGH = 40
"""Counts the other thread must make during one call (thousands when it is not blocked)."""


def counts_during(call: Callable[[], object]) -> int:
    """How often another thread counted while ``call`` ran (its second run: a first one may
    spend time outside the kernel, in allocations that let other threads run)."""
    call()
    count = 0
    stop = threading.Event()
    running = threading.Event()

    def counter() -> None:
        nonlocal count
        running.set()
        while not stop.is_set():
            count += 1
            stop.wait(0.0005)  # yields Python's lock, as a thread waiting on I/O does

    thread = threading.Thread(target=counter, daemon=True)
    thread.start()
    running.wait()
    before = count
    call()
    during = count - before
    stop.set()
    thread.join()
    return during


@pytest.fixture
def one_thread():
    """One torch thread: the counting thread has a core of its own."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def inputs(requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, CHANNELS, dtype=torch.float64, generator=generator)
    valid = torch.rand(ROWS, generator=generator) < 0.9
    scale = torch.ones(CHANNELS, dtype=torch.float64, requires_grad=requires_grad)
    bias = torch.zeros(CHANNELS, dtype=torch.float64, requires_grad=requires_grad)
    return x.requires_grad_(requires_grad), valid, scale, bias


def test_another_thread_runs_during_the_forward(one_thread):
    x, valid, scale, bias = inputs()
    assert counts_during(lambda: masked_layer_normalization(x, valid, scale, bias)) >= ENOUGH


def test_another_thread_runs_during_the_backward(one_thread):
    x, valid, scale, bias = inputs(requires_grad=True)
    y = masked_layer_normalization(x, valid, scale, bias)
    dy = torch.ones_like(y)
    backward = lambda: torch.autograd.grad(y, (x, scale, bias), dy, retain_graph=True)  # noqa: E731
    assert counts_during(backward) >= ENOUGH
