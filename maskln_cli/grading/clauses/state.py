"""torch's global state, as a call of the graded function may change it: read
(:func:`global_state`), compared (:func:`state_changes`), put back (:func:`restore`), and kept
around a whole clause (:func:`preserved_state`), so that a function that changes it changes
nothing for the clauses after it, nor for the process that grades in process.

The random state is read too (put back, and compared by :func:`state_changes` only when asked:
the ``no_reinit`` clause judges it).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import torch

PRINT_OPTIONS = ("precision", "threshold", "edgeitems", "linewidth", "sci_mode")


def _print_options() -> dict[str, Any]:
    from torch._tensor_str import PRINT_OPTS

    return {name: getattr(PRINT_OPTS, name) for name in PRINT_OPTIONS}


def _flushes_denormals() -> bool:
    """Whether denormal numbers are flushed to zero (torch.set_flush_denormal(True))."""
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    return bool((tiny * 1.0)[0] == 0)


def _autocast(device: str) -> tuple[bool, str]:
    try:
        return bool(torch.is_autocast_enabled(device)), str(torch.get_autocast_dtype(device))
    except (RuntimeError, TypeError, AttributeError):  # an older torch, or no such device
        return False, ""


def global_state() -> dict[str, Any]:
    """Every global setting of torch a function could change, by name (values as they are:
    :func:`restore` puts them back; :func:`state_changes` words them)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    default_device = getattr(torch, "get_default_device", lambda: torch.device("cpu"))()
    return {
        "default dtype": torch.get_default_dtype(),
        "default device": str(default_device),
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "deterministic algorithms": (
            deterministic,
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "threads": torch.get_num_threads(),
        "interop threads": torch.get_num_interop_threads(),
        "anomaly mode": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "autocast (cpu)": _autocast("cpu"),
        "autocast (cuda)": _autocast("cuda"),
        "autocast cache": torch.is_autocast_cache_enabled(),
        "print options": _print_options(),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "warn always": torch.is_warn_always_enabled(),
        "flush denormal": _flushes_denormals(),
        "random state": torch.get_rng_state(),
    }


def _digest(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return hashlib.sha1(value.numpy().tobytes()).hexdigest()[:12]
    return value


def state_changes(
    before: dict[str, Any], after: dict[str, Any], random_state: bool = False
) -> list[str]:
    """What differs, in words: ``default dtype torch.float32 -> torch.float64``. The random
    state only with ``random_state`` (no_reinit judges it)."""
    changes = []
    for name, old in before.items():
        if name == "random state" and not random_state:
            continue
        new = after.get(name)
        if _digest(old) != _digest(new):
            if name == "random state":
                changes.append("the random state changed (torch.manual_seed, or a draw)")
            else:
                changes.append(f"{name} {_digest(old)} -> {_digest(new)}")
    return changes


def restore(state: dict[str, Any]) -> None:
    """Put back what :func:`global_state` read (inference mode and interop threads cannot be
    set from here; everything else is)."""
    now = global_state()
    if now["default dtype"] != state["default dtype"]:
        torch.set_default_dtype(state["default dtype"])
    if now["default device"] != state["default device"] and hasattr(torch, "set_default_device"):
        torch.set_default_device(
            None if state["default device"] == "cpu" else state["default device"]
        )
    torch.set_grad_enabled(state["grad mode"])
    deterministic, warn_only = state["deterministic algorithms"]
    if now["deterministic algorithms"] != state["deterministic algorithms"]:
        # the flag itself: torch.use_deterministic_algorithms imports for 2 s the first time
        torch._C._set_deterministic_algorithms(deterministic, warn_only=warn_only)
    if now["threads"] != state["threads"]:
        torch.set_num_threads(state["threads"])
    if now["anomaly mode"] != state["anomaly mode"]:
        torch.autograd.set_detect_anomaly(*state["anomaly mode"])
    for device in ("cpu", "cuda"):
        if now[f"autocast ({device})"] != state[f"autocast ({device})"]:
            enabled, dtype = state[f"autocast ({device})"]
            with contextlib.suppress(RuntimeError, TypeError, AttributeError):
                torch.set_autocast_enabled(device, enabled)
                if dtype:
                    torch.set_autocast_dtype(device, getattr(torch, dtype.split(".")[-1]))
    if now["autocast cache"] != state["autocast cache"]:
        torch.set_autocast_cache_enabled(state["autocast cache"])
    if now["print options"] != state["print options"]:
        torch.set_printoptions(**state["print options"])
    if now["float32 matmul precision"] != state["float32 matmul precision"]:
        torch.set_float32_matmul_precision(state["float32 matmul precision"])
    if now["warn always"] != state["warn always"]:
        torch.set_warn_always(state["warn always"])
    if now["flush denormal"] != state["flush denormal"]:
        torch.set_flush_denormal(state["flush denormal"])
    if not torch.equal(now["random state"], state["random state"]):
        torch.set_rng_state(state["random state"])


@contextlib.contextmanager
def preserved_state() -> Iterator[None]:
    """torch's global state as it was, after the block, whatever ran in it."""
    saved = global_state()
    try:
        yield
    finally:
        restore(saved)


UNUSUAL_THREADS = 3
"""The thread count of the unusual state: the grader runs torch on one thread, so a function
that leaves torch on one thread (or "restores" one) is seen only from another count; three is
no machine's core count, nor torch's default. (The cases are small: no parallel region starts,
so more threads than cores cost nothing.)"""
UNUSUAL_STATE = {
    "default dtype": torch.float64,
    "print options": {"precision": 7, "threshold": 500, "edgeitems": 2, "linewidth": 100,
                      "sci_mode": True},
    "warn always": True,
    "threads": UNUSUAL_THREADS,
    "deterministic algorithms": (True, False),
    "anomaly mode": (True, False),
}  # fmt: skip
"""A state no one grades in: a function that "restores" what it changed to torch's defaults,
or to the grader's one thread, rather than to what it found, is seen changing it; so is one
that turns deterministic algorithms or anomaly mode on for itself, then "back" off. (Anomaly
mode without its NaN check: a correct function's backward may make NaN it then masks.)"""


@contextlib.contextmanager
def unusual_state() -> Iterator[None]:
    """Run the block in :data:`UNUSUAL_STATE`, the usual one after."""
    with preserved_state():
        restore({**global_state(), **UNUSUAL_STATE})
        yield
