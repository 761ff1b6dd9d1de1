"""Shared test setup: hypothesis profiles (`ci` is small and fast, `dev` larger)."""

import ast
import functools
import inspect
import os
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# One intra-op thread in the test process. The tests' tensors are tiny, so a second thread
# gains nothing, and a thread pool waits at every parallel region for all its threads: with
# the other core busy (a rank, a second test worker, another job) a GPT test ran 14x slower on
# two threads than on one. Ranks and commands set their own (one a rank).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_terminal_width(monkeypatch):
    """Drawings fit the terminal's width: every test sees the same one (the 120-column
    fallback), whatever COLUMNS the shell or a test runner set."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)


@pytest.fixture
def float64():
    """Build and train in float64 (what `--check` does), then restore the default dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


# The tiers: a test that starts processes (ranks through `spawn` or a multiprocessing context,
# the `schedcc` command through tests/_cli.py or `subprocess`, or `schedcc run`
# in-process) is marked `distributed`; the fast tier is `python -m pytest -m "not distributed"`.
# The mark is read off the test's own source and the module's helpers it calls (to any depth),
# so a new test lands in the right tier untold; a test that starts processes some other way (a
# compiler's workers) says so with `@pytest.mark.distributed`.
_ROOT = Path(__file__).resolve().parents[1]
_STARTS_PROCESSES = re.compile(
    r"\bspawn\(|\brun_cli\(|\bschedcc\(|\bstart_cli\(|\bsubprocess\.|\[\"run\"|\bget_context\("
    r"|\.Process\("
)


@functools.cache
def _function_sources(filename: str) -> dict[int, str]:
    """The source of each function defined in the file `filename`, by its first line (its first
    decorator's, as `co_firstlineno` counts): one parse a file, not one tokenizing a function."""
    text = Path(filename).read_text()
    lines = text.splitlines(keepends=True)
    out = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            out[first] = "".join(lines[first - 1 : node.end_lineno])
    return out


def _starting_helpers(module) -> set[str]:
    """The names of `module`'s functions that start processes, directly or through another."""
    sources = {}
    for name, value in vars(module).items():
        if inspect.isfunction(value):  # its own, and helpers it imports from this repository
            code = value.__code__
            if Path(code.co_filename).is_relative_to(_ROOT):
                source = _function_sources(code.co_filename).get(code.co_firstlineno)
                if source is not None:
                    sources[name] = source
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
