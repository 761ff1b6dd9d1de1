"""Shared test setup: hypothesis profiles (`ci` is small and fast, `dev` larger)."""

import inspect
import os
import re

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _no_terminal_width(monkeypatch):
    """Drawings fit the terminal's width: every test sees the same one (the 120-column
    fallback), whatever COLUMNS the shell or a test runner set."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)


# The tiers: a test that starts processes (ranks through `spawn` or a multiprocessing context,
# the `schedcc` command through tests/_cli.py or `subprocess`, or `schedcc run`
# in-process) is marked `distributed`; the fast tier is `python -m pytest -m "not distributed"`.
# The mark is read off the test's own source and the module's helpers it calls (to any depth),
# so a new test lands in the right tier untold; a test that starts processes some other way (a
# compiler's workers) says so with `@pytest.mark.distributed`.
_STARTS_PROCESSES = re.compile(
    r"\bspawn\(|\brun_cli\(|\bschedcc\(|\bstart_cli\(|\bsubprocess\.|\[\"run\"|\bget_context\("
    r"|\.Process\("
)


def _starting_helpers(module) -> set[str]:
    """The names of `module`'s functions that start processes, directly or through another."""
    sources = {}
    for name, value in vars(module).items():
        if inspect.isfunction(value):  # its own, and helpers it imports from other tests
            try:
                sources[name] = inspect.getsource(value)
            except (OSError, TypeError):
                continue
    starting = {name for name, source in sources.items() if _STARTS_PROCESSES.search(source)}
    while True:
        if not starting:
            return starting
        calls = re.compile(r"\b(" + "|".join(map(re.escape, starting)) + r")\b")
        more = {n for n, source in sources.items() if n not in starting and calls.search(source)}
        if not more:
            return starting
        starting |= more


def pytest_collection_modifyitems(config, items):
    helpers: dict[str, set[str]] = {}
    for item in items:
        function, module = getattr(item, "function", None), getattr(item, "module", None)
        if function is None or module is None:
            continue
        if module.__name__ not in helpers:
            helpers[module.__name__] = _starting_helpers(module)
        if function.__name__ in helpers[module.__name__]:
            item.add_marker(pytest.mark.distributed)
