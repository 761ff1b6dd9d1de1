"""`schedcc verify --recompute` checks the recomputing programs; `schedcc run --recompute`
trains them on the distributed engine, exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from schedcc.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_verify_checks_the_recomputing_programs(capsys):
    """`verify --recompute` validates the programs with an `R` before each backward: they pass
    (also under ZeRO-3) and hold one microbatch's activations per stage."""
    shape = ["--schedule", "1f1b", "-p", "4", "-m", "8", "--batches", "1"]
    assert main(["verify", *shape]) == 0
    assert "[4,3,2,1]" in capsys.readouterr().out
    assert main(["verify", *shape, "--recompute", "--dp", "2", "--zero", "3"]) == 0
    out = capsys.readouterr().out
    assert "[1,1,1,1]" in out
    assert "1 of 1 shapes pass" in out


def test_verify_recompute_over_a_grid_of_zero_bubble_shapes(capsys):
    """Split backwards too: every zb-h1 shape of the grid passes with `--recompute`."""
    assert main(["verify", "--schedule", "zb-h1", "-p", "2", "--recompute"]) == 0
    assert "FAIL" not in capsys.readouterr().out


def test_verify_refuses_recompute_with_a_torch_class(capsys):
    """torch's own schedules are checked as torch runs them: `--recompute` is one line, exit 2."""
    assert main(["verify", "--torch", "Schedule1F1B", "--recompute"]) == 2
    assert "--recompute" in capsys.readouterr().err


def test_run_recompute_trains_exactly_with_recomputed_forwards(tmp_path):
    """`run --recompute --check` (2 processes) recomputes each forward before its backward,
    as its measured trace shows, and still equals non-pipelined training in float64."""
    trace = tmp_path / "run.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    args = ["-p", "2", "-m", "2", "--model", "mlp", "--steps", "1", "--check", "--recompute"]
    result = subprocess.run(
        [sys.executable, "-m", "schedcc", "run", "--no-progress", *args, "--trace", str(trace)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert ": ok" in result.stdout
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e.get("name") for e in events}
    assert {"R0", "R1", "B0", "B1"} <= names
