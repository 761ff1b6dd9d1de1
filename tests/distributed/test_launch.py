"""Setting up and watching ranks' processes: the allocator keeps what it frees (see [Note: keeping
freed memory] in `backends/run/launch.py`; each check in a fresh interpreter, since the setting is
process-wide), and the watcher notices every rank's end, ending a stopped rank at once once
another has failed (see [Note: a rank that stops responding])."""

from __future__ import annotations

import multiprocessing
import os
import platform
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from schedcc.backends.run.launch import _end, _is_stopped, _watch, keep_freed_memory

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


linux = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")


def _stop_self() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)  # only if continued: never reached in these tests


def _fail_soon() -> None:
    time.sleep(0.5)
    os._exit(1)


def _forked(*targets):
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=target) for target in targets]
    for process in processes:
        process.start()
    return processes


def _kill_all(processes) -> None:
    for process in processes:
        if process.exitcode is None:
            process.kill()
        process.join(10)


def _wait_stopped(process, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not _is_stopped(process.pid):
        assert time.monotonic() < deadline, "the process did not stop"
        time.sleep(0.01)


@linux
def test_a_stopped_process_is_seen_as_stopped():
    """`_is_stopped` tells a SIGSTOPped process from a running one."""
    (process,) = _forked(_stop_self)
    try:
        _wait_stopped(process)
        os.kill(process.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while _is_stopped(process.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        _kill_all([process])


@linux
def test_the_watcher_ends_a_stopped_rank_at_once_after_another_failed(capsys):
    """One rank fails while another is stopped: the watcher names the stopped rank and ends it
    at once, not after the grace (60 s here), and returns the failed rank's code."""
    processes = _forked(_stop_self, _fail_soon)
    result = []
    try:
        _wait_stopped(processes[0])
        watcher = threading.Thread(
            target=lambda: result.append(_watch(processes, 60.0, lambda r: f"rank {r}")),
            daemon=True,
        )
        watcher.start()
        watcher.join(30)
    finally:
        _kill_all(processes)
    assert result == [1]
    assert processes[0].exitcode == -signal.SIGKILL
    assert "rank 0 is stopped (SIGSTOP or a debugger)" in capsys.readouterr().err


@linux
def test_ending_a_stopped_rank_delivers_its_sigterm():
    """`_end` continues a stopped rank after its SIGTERM, so it ends by that SIGTERM rather than
    by the SIGKILL that follows 3 s later."""
    (process,) = _forked(_stop_self)
    try:
        _wait_stopped(process)
        _end([process])
    finally:
        _kill_all([process])
    assert process.exitcode == -signal.SIGTERM
