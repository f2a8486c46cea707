import os

import pytest
from hypothesis import HealthCheck, settings

# `make test` runs a pytest-xdist worker per core: each runs torch on one thread, or the
# workers' threads outnumber the cores and every parallel op waits for its threads to be
# scheduled. Set here, before any test module is imported, so before torch runs an op and its
# OpenMP runtime starts a pool (tests/test_worker_threads.py checks both counts).
# MASKLN_WORKER_THREADS=N gives each worker N threads instead.
WORKER_THREADS = int(os.environ.get("MASKLN_WORKER_THREADS", "1"))
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(WORKER_THREADS)

    @pytest.fixture(autouse=True)
    def _worker_threads():
        """A test that changes torch's thread count leaves the next one its worker's."""
        yield
        if torch.get_num_threads() != WORKER_THREADS:
            torch.set_num_threads(WORKER_THREADS)


# `make test` keeps example counts modest; MASKLN_HYPOTHESIS_PROFILE=thorough runs many more.
settings.register_profile(
    "default",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("MASKLN_HYPOTHESIS_PROFILE", "default"))
