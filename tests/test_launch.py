"""Setting up and watching ranks' processes: the allocator keeps what it frees (see [Note: keeping
freed memory] in `backends/run/launch.py`; each check in a fresh interpreter, since the setting is
process-wide), and the watcher notices every rank's end."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
import threading

import pytest

from schedcc.backends.run.launch import _watch, keep_freed_memory

# Trains the step-time benchmark's model (4 x Linear(512) per stage, 2 stages, 2 chunks each)
# with interleaved 1F1B on the local backend and prints the pages faulted in by steps 16-23.
_FAULTS = textwrap.dedent(
    """
    import resource, sys
    import torch
    from torch import nn
    import torch.nn.functional as F
    import schedcc
    from schedcc.backends.run.launch import keep_freed_memory
    from schedcc.backends.local import Engine

    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    segments = [
        nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU())
        for _ in range(4)
    ]
    schedule = schedcc.get_schedule("interleaved-1f1b")(2, 8, 2, num_batches=1)
    engine = Engine(
        schedcc.compile(schedule), segments, F.mse_loss, lambda p: torch.optim.SGD(p, lr=1e-3)
    )
    x, y = torch.randn(64, 512), torch.randn(64, 512)
    faults = []
    for _ in range(24):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        engine.train_step(x, y)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(sum(faults[16:]))
    """
)

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")


def _faults(mode: str) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"):
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS, mode], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@glibc
def test_kept_memory_is_not_faulted_in_again():
    """Once warm, training steps fault in few pages: freed memory is reused in place. On the
    2-core machine, steps 16-23 faulted in 3-260 pages kept (a rare new peak of the heap costs
    a few hundred) against 9,400-16,700 with glibc's default trimming."""
    assert _faults("keep") < 2048


@glibc
def test_thresholds_set_by_the_user_are_left_alone(monkeypatch):
    """MALLOC_TRIM_THRESHOLD_ in the environment: the user chose; nothing is changed."""
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert keep_freed_memory() is False


class _EndsBetweenLooks:
    """A rank seen running at the first look and ended from the next one on: the race between
    a watcher's looks at its ranks that once left it waiting on no rank at all, forever."""

    def __init__(self):
        read, write = os.pipe()
        os.close(write)  # an ended process's sentinel: ready to read
        self.sentinel = read
        self.looks = 0

    @property
    def exitcode(self):
        self.looks += 1
        return None if self.looks == 1 else 0


def test_the_watcher_notices_a_rank_that_ends_while_it_looks():
    """spawn's watcher returns 0 when the last rank ends between two of its looks."""
    rank = _EndsBetweenLooks()
    result = []
    watcher = threading.Thread(target=lambda: result.append(_watch([rank], 1.0, str)), daemon=True)
    watcher.start()
    watcher.join(10)
    os.close(rank.sentinel)
    assert result == [0]
