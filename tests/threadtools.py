"""Test helpers for tests that need torch's intra-op threads on several OpenMP threads."""

from __future__ import annotations

import pytest
import torch

from maskln_cli.op import threads


def has_thread_setter() -> bool:
    """Whether the per-thread setter is found, checked with torch on 2 threads: on 1 (a
    pytest-xdist worker's, see tests/conftest.py) nothing tells a working one."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return threads._thread_setter() is not None
    finally:
        torch.set_num_threads(before)


openmp = pytest.mark.skipif(not has_thread_setter(), reason="no per-thread OpenMP setter")
"""Skips a test where maskln cannot set a pool thread's OpenMP threads."""
