"""A call's time limit comes from maskln's op's time on the same case, times 10,000: that
reference is the op's own CPU time, as a call's window leaves out what it waited for a CPU.
Timed in wall time, one preemption of the millisecond's op on a loaded machine (a round of the
scheduler, tens of milliseconds) made the limit the clause's minute, and a hang ran to it (CI,
`test_a_hang_in_second_order_still_fails_on_a_loaded_machine`, on the raw-op backend)."""

from __future__ import annotations

import time

import pytest

from maskln_cli.grading import clauses
from maskln_cli.grading.child import FLOOR_SECONDS, TIME_FACTOR, CallLimits
from maskln_cli.op import api

PAUSE = 0.02
"""A pause inside the op that is not its thread's work, as a preemption is: 10,000 times it
is 200 s, past any clause's limit."""


@pytest.fixture
def op_paused(monkeypatch):
    real = api.masked_layer_normalization

    def paused(*args, **kwargs):
        time.sleep(PAUSE)  # the thread does not run, as when it waits for a CPU
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "masked_layer_normalization", paused)


def second_order_cases():
    return clauses.CLAUSES["second_order"].build(0)


def test_a_pause_in_the_op_does_not_lengthen_the_limits(op_paused):
    limits = CallLimits(second_order_cases(), "cpu")
    assert limits.by_input, "no case was timed"
    # the op's own time on these tiny cases is about a millisecond: 10 s or so
    assert limits.slowest < TIME_FACTOR * PAUSE / 4, limits.by_input


def test_the_limits_still_scale_with_the_ops_own_work(monkeypatch):
    """The reference is the op's work, not nothing: an op that spins its thread for the pause
    (CPU time) lengthens the limits by 10,000 times the spin."""
    real = api.masked_layer_normalization

    def spinning(*args, **kwargs):
        end = time.thread_time() + PAUSE
        while time.thread_time() < end:
            pass
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "masked_layer_normalization", spinning)
    limits = CallLimits(second_order_cases(), "cpu")
    assert min(limits.by_input.values()) >= TIME_FACTOR * PAUSE, limits.by_input


def test_a_call_may_take_the_floor_at_least():
    limits = CallLimits(second_order_cases(), "cpu")
    assert limits.seconds((), {}) >= FLOOR_SECONDS
