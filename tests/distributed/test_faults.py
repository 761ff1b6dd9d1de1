"""Faults end fast and named: a stopped rank ends every rank within the timeout plus a few
seconds, and a rank killed while the others are in a collective gives the same one-line, named
failure as one killed in point-to-point, never a gloo traceback (see [Note: failures] in
`backends/distributed/engine.py` and [Note: a rank that stops responding] in
`backends/run/launch.py`).

Every test runs its ranks in a child process of its own session (2 gloo processes on 127.0.0.1,
or 4 for data parallelism), bounded by a timeout, and ends them all whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
#: The waits' timeout in these tests, and the slack a loaded 2-core machine gets on top of it to
#: end every rank (measured: about 1 s unloaded).
TIMEOUT = 5
SLACK = 10

# Ranks of a small pipeline (p, dp from CASE) that train a step, save a checkpoint, and then
# meet a fault at the collective CASE names: rank 0 touches ROOT/at-collective just before it
# enters that collective, and the victim (the last rank) kills or stops itself at its own call of
# it once the file is there, so rank 0 is in the collective when its peer goes.
_WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    from datetime import timedelta
    from pathlib import Path
    import torch
    import torch.distributed as dist
    import schedcc
    from schedcc.backends.distributed.engine import Engine
    from schedcc.backends.run.launch import spawn

    CASE, HOW, ROOT, TIMEOUT = sys.argv[1], sys.argv[2], Path(sys.argv[3]), float(sys.argv[4])
    SHAPE = {"save": (2, 1), "load": (2, 1), "loss": (2, 1), "reduce": (1, 2), "subgroup": (2, 2)}
    CALL = {
        "save": "all_gather_object",
        "load": "all_gather_object",
        "loss": "all_reduce",
        "reduce": "all_reduce",
        "subgroup": "all_reduce",
    }
    MARK = ROOT / "at-collective"
    #: calls of CALL[CASE] a step makes before the one the case is about (the batch check's)
    BEFORE = {"loss": 1, "reduce": 1, "subgroup": 1}.get(CASE, 0)

    def passing(real, then):
        seen = [0]
        def call(*args, **kwargs):
            seen[0] += 1
            if seen[0] <= BEFORE:
                return real(*args, **kwargs)
            return then(real, *args, **kwargs)
        return call

    def entering(real, *args, **kwargs):
        MARK.touch()
        return real(*args, **kwargs)

    def fault(real, *args, **kwargs):
        deadline = time.monotonic() + 60
        while CASE != "subgroup" and not MARK.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        (ROOT / "fault").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL if HOW == "kill" else signal.SIGSTOP)

    def worker(rank, world):
        torch.set_num_threads(1)
        timeout = timedelta(seconds=TIMEOUT)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        p, dp = SHAPE[CASE]
        torch.manual_seed(0)
        segments = [torch.nn.Linear(4, 4) for _ in range(p)]
        program = schedcc.compile(schedcc.get_schedule("1f1b")(p, 2), data_parallel=dp)
        engine = Engine(
            program,
            segments,
            torch.nn.functional.mse_loss,
            lambda params: torch.optim.SGD(params, lr=0.1),
            timeout=TIMEOUT,
        )
        batch = (torch.randn(4, 4), torch.randn(4, 4))
        engine.train_step(*batch)
        engine.save(ROOT / "first")
        name = CALL[CASE]
        if rank == world - 1:
            setattr(dist, name, passing(getattr(dist, name), fault))
        elif rank == 0:
            setattr(dist, name, passing(getattr(dist, name), entering))
        if CASE == "save":
            engine.save(ROOT / "second")
        elif CASE == "load":
            engine.load(ROOT / "first")
        else:
            engine.train_step(*batch)
        return 0

    if __name__ == "__main__":
        world = SHAPE[CASE][0] * SHAPE[CASE][1]
        code = spawn(worker, world, grace=60.0)
        (ROOT / "ended").write_text(repr(time.time()))
        sys.exit(code)
    """
)


def _run_worker(tmp_path: Path, case: str, how: str) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    command = [sys.executable, str(script), case, how, str(tmp_path), str(TIMEOUT)]
    return _bounded(command, limit=240)


def _bounded(command: list[str], *, limit: float) -> subprocess.CompletedProcess:
    """Run `command` in its own session; past `limit` seconds end all of it and fail."""
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _end_session(proc)
        out, err = proc.communicate()
        pytest.fail(f"the ranks were still running after {limit:g}s:\n{err[-3000:]}")
    finally:
        _end_session(proc)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _end_session(proc: subprocess.Popen) -> None:
    """End every process of the child's session (a stopped rank included)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _rank_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("schedcc: rank ")]


COLLECTIVES = [
    ("save", r"failed at the checkpoint save, a collective over ranks \[0, 1\]"),
    ("load", r"failed at the checkpoint load, a collective over ranks \[0, 1\]"),
    ("loss", r"failed at the loss reduction, a collective over ranks \[0, 1\]"),
    (
        "reduce",  # launched at the Reduce, waited at the Step
        r"failed at Step, a collective over the data-parallel ranks \[0, 1\]: the Reduce launched "
        "earlier",
    ),
]


@pytest.mark.parametrize(("case", "message"), COLLECTIVES)
def test_a_rank_killed_in_a_collective_gives_one_named_line(tmp_path, case, message):
    """Rank 1 killed while rank 0 is in a collective: rank 0 says, in one line, which rank and
    stage it is, which collective it was in and over which ranks; no traceback."""
    done = _run_worker(tmp_path, case, "kill")
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    assert "schedcc: rank 1 was killed by signal 9" in done.stderr
    (line,) = [line for line in _rank_lines(done.stderr) if line.startswith("schedcc: rank 0:")]
    assert re.match(r"schedcc: rank 0: rank 0 \(stage 0\) " + message + ": .+", line), line


def test_a_stopped_rank_in_a_subgroup_collective_ends_every_rank_within_the_timeout(tmp_path):
    """p = 2, dp = 2: rank 3 stops at ReduceGrads, a collective over a data-parallel group the
    mesh made (torch's default timeout for it is 30 minutes). Every other rank ends within the
    engine's timeout plus a few seconds, each with its own named line, and the stopped rank is
    named and ended."""
    done = _run_worker(tmp_path, "subgroup", "stop")
    stopped = float((tmp_path / "fault").read_text())
    ended = float((tmp_path / "ended").read_text())
    assert ended - stopped < TIMEOUT + SLACK, done.stderr
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    assert "schedcc: rank 3 is stopped (SIGSTOP or a debugger)" in done.stderr
    lines = _rank_lines(done.stderr)
    for rank in range(3):
        (line,) = [line for line in lines if line.startswith(f"schedcc: rank {rank}:")]
        assert re.match(rf"schedcc: rank {rank}: rank {rank} \(stage \d\) failed .+: .+", line)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(word) for word in out.stdout.split()]


def test_schedcc_run_with_a_stopped_rank_ends_within_the_timeout(tmp_path):
    """`schedcc run --timeout 5` with one rank stopped mid-training: the command returns within
    the timeout plus 2 s (the ranks' waits time out, the launcher ends the stopped rank at once
    and exits without tearing torch down), rank 0 names what it waited on, the launcher the
    stopped rank."""
    root = tmp_path / "ckpt"
    command = [
        sys.executable,
        "-m",
        "schedcc",
        "run",
        "--no-progress",
        "--model",
        "mlp",
        "--timeout",
        str(TIMEOUT),
        "--steps",
        "100000",
        "--checkpoint",
        str(root),
        "--every",
        "2",
    ]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not (root / "step-00000002" / "manifest.json").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.02)
        victim = _children(proc.pid)[-1]
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=120)
        elapsed = time.monotonic() - stopped
    finally:
        _end_session(proc)
    assert elapsed < TIMEOUT + 2, err
    assert proc.returncode == 1
    assert "Traceback" not in err, err
    assert "schedcc: rank 1 (stage 1, dp 0) is stopped (SIGSTOP or a debugger)" in err
    (line,) = [line for line in _rank_lines(err) if line.startswith("schedcc: rank 0:")]
    assert re.match(r"schedcc: rank 0: rank 0 \(stage 0\) failed .+: .+", line), line
