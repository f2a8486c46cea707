"""`make test` runs a pytest-xdist worker per core: each runs torch on one thread (tests/conftest.py
sets it before any test module is imported, so before torch starts a pool of threads). torch on
every core in every worker made 2 workers run 4 threads on 2 cores: each parallel op waiting
for its threads to be scheduled."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest
import torch

from maskln_cli.op import threads

pytestmark = pytest.mark.skipif(
    not os.environ.get("PYTEST_XDIST_WORKER") or "MASKLN_WORKER_THREADS" in os.environ,
    reason="one torch thread per pytest-xdist worker (unless MASKLN_WORKER_THREADS says more)",
)


def _in_new_thread(function):
    result = []
    thread = threading.Thread(target=lambda: result.append(function()))
    thread.start()
    thread.join()
    return result[0]


def test_a_worker_runs_torch_on_one_thread():
    assert torch.get_num_threads() == 1
    # a thread that touches torch for the first time now gets one thread too
    assert _in_new_thread(torch.get_num_threads) == 1


def test_openmp_runs_one_thread_in_a_worker():
    """What torch's parallel ops actually use: the OpenMP runtime's own count, in this thread
    and in a new one."""
    runtimes = threads._loaded_openmp()
    if not runtimes:
        pytest.skip("no OpenMP runtime loaded")
    runtime = ctypes.CDLL(runtimes[0])
    torch.ones(1 << 20).sum()  # a parallel op: the pool starts, if it ever does
    assert runtime.omp_get_max_threads() == 1

    def counted() -> int:
        torch.ones(1 << 20).sum()
        return runtime.omp_get_max_threads()

    assert _in_new_thread(counted) == 1
