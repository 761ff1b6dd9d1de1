"""`schedcc run`, `show` and `verify` take `--zero 3`; a combination ZeRO-3 cannot run is one
line and exit 2."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from _cli import run_cli

from schedcc.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=timeout)


def test_run_zero_3_checks_equal_to_non_pipelined():
    """`run --dp 2 --zero 3 --check` (4 processes) trains the built-in GPT sharded, its tied
    head included, and matches non-pipelined training in float64."""
    result = _run("--dp", "2", "--zero", "3", "--steps", "2", "--check")
    assert result.returncode == 0, result.stderr
    assert "zero=3" in result.stdout
    assert "check: largest parameter difference" in result.stdout
    assert ": ok" in result.stdout


def test_run_zero_3_with_a_weight_delay_is_one_line():
    """`run --zero 3 --schedule 2bw` is refused before anything starts: one line, exit 2."""
    result = _run("--schedule", "2bw", "--dp", "2", "--zero", "3")
    assert result.returncode == 2
    assert "zero=3 cannot run" in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_show_and_verify_take_zero_3(tmp_path, capsys):
    """`show --zero 3` draws the gathers and releases at their costs; `verify --zero 3` passes
    every shape."""
    trace = tmp_path / "z3.json"
    argv = [
        "show",
        "--schedule",
        "1f1b",
        "-p",
        "2",
        "-m",
        "2",
        "--dp",
        "2",
        "--zero",
        "3",
        "--costs",
        "gather=1",
    ]
    assert main([*argv, "--format", "chrome", "-o", str(trace)]) == 0
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = {e["name"]: e["dur"] for e in events if e.get("name") in ("Unshard", "Reshard")}
    assert spans["Unshard"] == 1000  # one cost unit is 1 ms in the trace
    assert "Reshard" in spans
    argv = ["verify", "--schedule", "interleaved-1f1b", "-p", "2", "-m", "4", "--zero", "3"]
    assert main([*argv, "--dp", "2"]) == 0
    assert "4 of 4 shapes pass" in capsys.readouterr().out
