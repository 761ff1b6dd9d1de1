"""`schedcc run` as a user starts it (a fresh process, outside any torchrun, one thread a rank),
and the rows of `schedcc verify`'s table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """`python -m schedcc run --no-progress ARGS` from the repository root, output captured."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-m", "schedcc", "run", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**env, "OMP_NUM_THREADS": "1"},
    )


def verify_rows(out: str) -> list[list[str]]:
    """The rows of `schedcc verify`'s table in `out`: p, m, v, batches, the result, ..."""
    rows = [line.split() for line in out.splitlines()]
    return [cells for cells in rows if len(cells) > 4 and all(c.isdigit() for c in cells[:4])]
