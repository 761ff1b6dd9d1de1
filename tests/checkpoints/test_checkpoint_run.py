"""`schedcc run --checkpoint/--every/--resume` on gloo: a crashed run resumes to the same bits."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _cli import run_cli, schedcc

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run_cli("--timeout", "20", *args, timeout=timeout, env=ENV)


def _assert_same_checkpoint(a: Path, b: Path) -> None:
    """Every shard of two checkpoints holds the same parameters and optimizer state, bitwise."""
    names = sorted(p.name for p in a.glob("*.pt"))
    assert names == sorted(p.name for p in b.glob("*.pt"))
    assert names
    for name in names:
        mine, theirs = torch.load(a / name), torch.load(b / name)
        for left, right in zip(mine["modules"], theirs["modules"], strict=True):
            assert left.keys() == right.keys()
            assert all(torch.equal(left[k], right[k]) for k in left), name
        for key, state in mine["optimizer"]["state"].items():
            other = theirs["optimizer"]["state"][key]
            assert all(torch.equal(state[k], other[k]) for k in state), name


CASES = [
    ("1f1b", ["-m", "4", "--dp", "2", "--zero", "1", "--model", "mlp"], 2),
    ("interleaved-1f1b", ["-v", "2", "-m", "4", "--dp", "2", "--zero", "1", "--model", "mlp"], 2),
    ("2bw", ["-m", "4", "--dp", "2", "--zero", "1", "--model", "mlp"], 4),
]


@pytest.mark.parametrize(("schedule", "args", "every"), CASES)
def test_resumed_run_equals_uninterrupted_bit_for_bit(tmp_path, schedule, args, every):
    """Resuming from the first checkpoint reproduces the uninterrupted run's last checkpoint."""
    steps = 2 * every
    whole = tmp_path / "whole"
    done = _run(
        "--schedule",
        schedule,
        *args,
        "--steps",
        str(steps),
        "--checkpoint",
        str(whole),
        "--every",
        str(every),
    )
    assert done.returncode == 0, done.stderr
    resumed = tmp_path / "resumed"
    first = f"step-{every:08d}"
    shutil.copytree(whole / first, resumed / first)
    again = _run(
        "--schedule",
        schedule,
        *args,
        "--steps",
        str(steps),
        "--checkpoint",
        str(resumed),
        "--every",
        str(every),
        "--resume",
    )
    assert again.returncode == 0, again.stderr
    assert f"resumed from {resumed / first} (step {every})" in again.stdout
    last = f"step-{steps:08d}"
    _assert_same_checkpoint(whole / last, resumed / last)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(word) for word in out.stdout.split()]


def test_killed_rank_then_resume_completes_like_uninterrupted(tmp_path):
    """Kill a rank mid-run: every rank exits non-zero, and --resume ends where a clean run ends."""
    steps, common = 40, ["--steps", "40", "--every", "2"]
    whole = tmp_path / "whole"
    assert _run(*common, "--checkpoint", str(whole)).returncode == 0

    crashed = tmp_path / "crashed"
    command = [
        sys.executable,
        "-m",
        "schedcc",
        "run",
        "--no-progress",
        "--timeout",
        "20",
        *common,
        "--checkpoint",
        str(crashed),
    ]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )
    try:
        deadline = time.monotonic() + 120
        while not (crashed / "step-00000002" / "manifest.json").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        victim = _children(proc.pid)[-1]
        os.kill(victim, signal.SIGKILL)
        started = time.monotonic()
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert time.monotonic() - started < 60
    assert "killed by signal 9" in err
    assert "failed waiting" in err or "failed at" in err
    assert "Traceback" not in err, err  # a peer lost in a collective is named too
    assert not (crashed / f"step-{steps:08d}").exists()

    resumed = _run(*common, "--checkpoint", str(crashed), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    last = f"step-{steps:08d}"
    _assert_same_checkpoint(whole / last, crashed / last)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--every", "2"], "--every and --resume need --checkpoint DIR"),
        (["--schedule", "2bw", "--checkpoint", "x", "--every", "3"], "use a multiple of 4"),
        (["--checkpoint", "x", "--resume", "--check"], "cannot follow --resume"),
    ],
)
def test_bad_checkpoint_flags_are_one_line_and_exit_2(tmp_path, args, message):
    """Checkpoint flags that cannot work are refused before any process starts."""
    done = schedcc("run", *args, timeout=60, env=ENV, cwd=tmp_path)
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
