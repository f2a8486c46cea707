"""Blocks on worker threads (maskln_cli.op.threads): one torch thread each, and nothing leaks.

The raw-op kernels run on them; the op is on its raw backend here whichever is the default.
"""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest
import torch

from maskln_cli import masked_layer_normalization
from maskln_cli.op import blocked as core
from maskln_cli.op import threads
from maskln_cli.op.threads import Blocks, map_blocks, one_thread, workers
from tests.threadtools import openmp


@pytest.fixture(autouse=True)
def raw_backend(on_backend):
    on_backend("raw")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _in_new_thread(function):
    """``function()`` run in a fresh Python thread, which has never touched torch before."""
    result = []
    thread = threading.Thread(target=lambda: result.append(function()))
    thread.start()
    thread.join()
    return result[0]


@openmp
def test_one_thread_is_the_calling_threads_alone(two_threads):
    with one_thread():
        assert torch.get_num_threads() == 1
        # A thread that first touches torch meanwhile gets the process's count, not ours:
        # torch.set_num_threads(1) here would have given it 1 for its whole life.
        assert _in_new_thread(torch.get_num_threads) == 2
    assert torch.get_num_threads() == 2


@openmp
def test_workers_run_torch_on_one_thread_and_the_caller_keeps_its_own(two_threads):
    assert workers() == 2
    seen = map_blocks(lambda _: (threading.get_ident(), torch.get_num_threads()), range(8))
    assert {count for _, count in seen} == {1}
    assert threading.get_ident() not in {ident for ident, _ in seen}
    assert torch.get_num_threads() == 2
    assert _in_new_thread(torch.get_num_threads) == 2


def test_results_in_order_and_the_first_error_after_every_item_finished(two_threads):
    assert map_blocks(lambda n: n * n, range(20)) == [n * n for n in range(20)]
    finished = []

    def work(n: int) -> int:
        if n == 3:
            raise ValueError("item 3")
        threading.Event().wait(0.01)
        finished.append(n)
        return n

    with pytest.raises(ValueError, match="item 3"):
        map_blocks(work, range(8))
    assert sorted(finished) == [0, 1, 2, 4, 5, 6, 7]


@openmp
def test_started_blocks_run_while_the_caller_works(two_threads):
    """Blocks(...) queues the items on the pool and returns: the caller works meanwhile (verify
    merges the figures of one group of blocks while the next group's are measured), then
    results() gives them in order."""
    started = threading.Event()

    def work(n: int) -> int:
        started.set()
        return n * n

    blocks = Blocks(work, range(6))
    assert started.wait(timeout=10)  # a worker ran an item before results() was called
    assert blocks.results() == [n * n for n in range(6)]


def test_started_blocks_on_one_worker_run_when_their_results_are_asked():
    """With one worker (torch on one thread) the items run in the calling thread, in order,
    when results() is called: work the caller does in between comes first, as it would in a
    plain loop."""
    seen: list[str] = []
    with one_thread():
        blocks = Blocks(lambda n: seen.append(f"item {n}"), range(3))
        seen.append("caller")
        blocks.results()
    assert seen == ["caller", "item 0", "item 1", "item 2"]


def test_cancelled_blocks_never_start_and_none_runs_after(two_threads):
    """cancel() (the caller failed before asking for the results): items not started never
    run, those running are waited for."""
    import time

    finished = []

    def work(n: int) -> None:
        time.sleep(0.02)
        finished.append(n)

    blocks = Blocks(work, range(40))
    time.sleep(0.05)
    blocks.cancel()
    after_call = len(finished)
    time.sleep(0.2)
    assert len(finished) == after_call < 40


def test_workers_take_the_callers_grad_and_inference_modes(two_threads):
    with torch.no_grad():
        assert map_blocks(lambda _: torch.is_grad_enabled(), range(4)) == [False] * 4
    assert map_blocks(lambda _: torch.is_grad_enabled(), range(4)) == [True] * 4
    with torch.inference_mode():
        assert map_blocks(lambda _: torch.is_inference_mode_enabled(), range(4)) == [True] * 4
        x = torch.randn(64, 1024)  # an inference tensor: updated in place by the workers
        y = masked_layer_normalization(
            x, torch.ones(64, dtype=torch.bool), torch.ones(1024), torch.zeros(1024)
        )
    expected = torch.nn.functional.layer_norm(x.double(), (1024,))
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=1e-5)


def test_a_nested_call_runs_in_its_worker(two_threads):
    def outer(_: int) -> list[int]:
        return map_blocks(lambda _: threading.get_ident(), range(4))

    for idents in map_blocks(outer, range(4)):
        assert len(set(idents)) == 1


def _child_maps(queue) -> None:
    queue.put(map_blocks(lambda n: (n, torch.get_num_threads()), range(4)))


@openmp
def test_a_forked_child_makes_its_own_pool(two_threads):
    map_blocks(lambda n: n, range(4))  # the parent's pool exists
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_maps, args=(queue,))
    child.start()
    result = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert result == [(n, 1) for n in range(4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_op_gives_the_same_bits_on_any_number_of_threads(dtype, monkeypatch):
    """Every op of a block runs on one thread, so nothing depends on how many there are, the
    sums over rows (grad_scale, grad_bias) included."""
    monkeypatch.setattr(core, "BLOCK_BYTES", 64 << 10)  # several blocks
    monkeypatch.setattr(core, "BACKWARD_BLOCK_BYTES", 64 << 10)
    monkeypatch.setattr(core, "MIN_BLOCK_BYTES", 16 << 10)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 7, 256, generator=generator, dtype=dtype) * 3 + 100
    valid = torch.rand(96, 7, generator=generator) > 0.3
    scale, bias, dy = (
        torch.randn(shape, generator=generator, dtype=dtype) for shape in (256, 256, x.shape)
    )

    def run() -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (x, scale, bias)]
        out = masked_layer_normalization(leaves[0], valid, leaves[1], leaves[2])
        return [out.detach(), *torch.autograd.grad(out, leaves, dy)]

    before = torch.get_num_threads()
    try:
        results = {}
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results[count] = run()
    finally:
        torch.set_num_threads(before)
    for count in (2, 3):
        for ours, alone in zip(results[count], results[1], strict=True):
            assert torch.equal(ours, alone)
    # and right: against float64 torch on the valid rows
    reference = torch.nn.functional.layer_norm(x.double(), (256,), scale.double(), bias.double())
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(
        results[1][0][valid].double(), reference[valid], rtol=0, atol=tolerance
    )
    assert bool((results[1][0][~valid] == 0).all())


def test_a_pool_that_no_longer_takes_work_leaves_the_work_to_the_caller(two_threads, monkeypatch):
    """At interpreter shutdown concurrent.futures refuses new work (the op, called from a
    thread that outlives the main script or from atexit, raised "cannot schedule new futures")."""
    from concurrent.futures import ThreadPoolExecutor

    closed = ThreadPoolExecutor(2)
    closed.shutdown()
    monkeypatch.setattr(threads, "_executor", lambda size: closed)
    assert map_blocks(lambda n: (n, torch.get_num_threads()), range(6)) == [
        (n, 1) for n in range(6)
    ]


@openmp
def test_threads_with_different_torch_thread_counts_call_at_once():
    """Each count has a pool of its own: one caller never shuts down another's."""
    errors, done = [], []

    def caller(count: int) -> None:
        torch.set_num_threads(count)  # this thread's own (it is new)
        try:
            for _ in range(100):
                assert map_blocks(lambda n: n + 1, range(6)) == [1, 2, 3, 4, 5, 6]
            done.append(count)
        except BaseException as error:  # reported below
            errors.append(error)

    before = torch.get_num_threads()
    try:
        callers = [threading.Thread(target=caller, args=(count,)) for count in (2, 3)]
        for thread in callers:
            thread.start()
        for thread in callers:
            thread.join()
    finally:
        torch.set_num_threads(before)
    assert errors == [] and sorted(done) == [2, 3]


def test_an_interruption_cancels_what_has_not_started(two_threads):
    """Ctrl-C (here a signal whose handler raises, as SIGINT's does) while waiting for the
    blocks: those not started never run, and none is still running after the call."""
    import signal
    import time

    finished = []

    def work(n: int) -> None:
        time.sleep(0.05)
        finished.append(n)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        timer = threading.Timer(0.12, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            map_blocks(work, range(40))
        after_call = len(finished)
        time.sleep(0.3)
        assert len(finished) == after_call < 40
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("mode", ["dispatch", "profiler"])
def test_ops_stay_in_the_callers_thread_under_a_dispatch_mode_or_profiler(two_threads, mode):
    """Both are per thread: ops on a worker would escape them (a flop counter, maskln grade's
    check for ready-made layer norms, a profile). A dispatch mode sees the op itself."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((threading.get_ident(), str(func)))
            return func(*args, **(kwargs or {}))

    x = torch.randn(4096, 512)  # 8 MiB: many blocks
    valid, scale, bias = torch.ones(4096, dtype=torch.bool), torch.ones(512), torch.zeros(512)
    if mode == "dispatch":  # the mode sees the registered op, as one op, in this thread
        with Record():
            masked_layer_normalization(x, valid, scale, bias)
        assert seen == [(threading.get_ident(), "maskln.masked_layer_norm.default")]
        return
    else:
        with torch.profiler.profile() as profile:
            masked_layer_normalization(x, valid, scale, bias)
        names = [event.name for event in profile.events()]
    blocks = len(list(core.row_blocks(4096, core._block_rows(x, core._block_bytes(x, 1 << 30)))))
    assert sum("linalg_vector_norm" in name for name in names) >= blocks > 1
