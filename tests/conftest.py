import os

from hypothesis import HealthCheck, settings

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
