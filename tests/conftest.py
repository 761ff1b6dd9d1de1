"""Shared test setup: hypothesis profiles (`ci` is small and fast, `dev` larger), and
`schedcc run` allowed more ranks than cores."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The suite runs 4-rank `schedcc run`s on 2-core machines on purpose (slowly, but correctly):
# every child process inherits `--oversubscribe` (see [Note: one core a rank]).
os.environ["SCHEDCC_OVERSUBSCRIBE"] = "1"
