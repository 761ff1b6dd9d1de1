"""The torch.distributed backend: equal to the local backend, data parallel, failures end runs.

Each test is one multi-process launch (gloo on 127.0.0.1, forked from this process, one thread
each) that checks several programs in the same process group; a rank that sees a difference
raises, which makes the launch exit non-zero.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import compare, compare_program, init, optimizer
from _written import CLASS_A, written
from torch import nn

import schedcc
from schedcc.backends.distributed.engine import Engine
from schedcc.backends.distributed.groups import Groups
from schedcc.backends.distributed.shm import ShmLinks
from schedcc.backends.run import models
from schedcc.backends.run.launch import cores_for, spawn
from schedcc.errors import RankFailure, ScheduleConfigError, UserCodeError

#: (schedule, p, v, num_batches, batches trained).
SCHEDULES = [
    ("gpipe", 2, 1, 1, 2),
    ("1f1b", 2, 1, 1, 2),
    ("interleaved-1f1b", 2, 2, 1, 2),
    ("2bw", 2, 1, 2, 4),
    ("zb-h1", 2, 1, 1, 2),
    ("zb-v", 2, 2, 1, 2),
]


def _pipeline_worker(rank: int, world_size: int) -> int:
    init(rank, world_size)
    for case in SCHEDULES:
        compare(rank, *case)
    # the same over gloo, and a pair where only one side offers shared memory (it uses gloo)
    compare(rank, "interleaved-1f1b", 2, 2, 1, 2, linked=False, p2p="gloo")
    compare(rank, "1f1b", 2, 1, 1, 2, linked=False, p2p="shm" if rank == 0 else "gloo")
    _linking_fails(rank)
    return 0


def _linking_fails(rank: int) -> None:
    """A failure while linking same-host stages is a `RankFailure` naming the rank, not a trace."""

    def refuse(cls, *args, **kwargs):
        raise OSError("linking refused")

    real = ShmLinks.connect
    ShmLinks.connect = classmethod(refuse)
    try:
        program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
        engine = Engine(program, models.mlp_segments(2, width=8, seed=1), F.mse_loss, optimizer)
        x, y = models.TeacherData(width=8, seed=2).batch(4, 0)
        expected = f"rank {rank} \\(stage {rank}\\) could not link with its peers on this machine"
        with pytest.raises(RankFailure, match=f"{expected}: linking refused"):
            engine.train_step(x, y)
    finally:
        ShmLinks.connect = real


def _written_worker(rank: int, world_size: int) -> int:
    init(rank, world_size)
    compare_program(rank, written(*CLASS_A), 2)  # shared memory
    compare_program(rank, written(*CLASS_A), 2, linked=False, p2p="gloo")  # gloo p2p
    return 0


def test_a_comm_group_that_receives_before_it_sends_equals_local():
    """Class A (`F0 [RG0 SA0] B0 Step` / `[RA0] F0 B0 [SG0] Step`, hand-written) trains
    on 2 ranks, over shared memory and over gloo point-to-point, to the local backend's numbers."""
    assert spawn(_written_worker, 2, grace=30, threads=1) == 0


def _data_parallel_worker(rank: int, world_size: int) -> int:
    init(rank, world_size)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    compare(rank, "1f1b", 2, 1, 1, 2, dp=2, zero=0)  # the engine builds its own mesh
    compare(rank, "1f1b", 2, 1, 1, 2, dp=2, zero=1, groups=mesh)
    groups = Groups(pp=mesh.get_group("pp"), dp=mesh.get_group("dp"))  # Megatron-style groups
    compare(rank, "gpipe", 2, 1, 1, 2, dp=2, zero=1, groups=groups)
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4), data_parallel=2)
    segments = models.mlp_segments(2, width=8, seed=1)
    with pytest.raises(ScheduleConfigError, match="takes a DeviceMesh or a schedcc Groups"):
        Engine(program, segments, F.mse_loss, optimizer, groups={"pp": mesh.get_group("pp")})
    return 0


def test_distributed_equals_local_for_every_schedule():
    """On 2 ranks, every built-in schedule trains to the local backend's weights and losses."""
    assert spawn(_pipeline_worker, 2, grace=30, threads=1, bind_cores=True) == 0


def _three_stage_worker(rank: int, world_size: int) -> int:
    init(rank, world_size)
    for name, v, per_run in (("1f1b", 1, 1), ("interleaved-1f1b", 2, 1), ("zb-v", 2, 1)):
        compare(rank, name, 3, v, per_run, 2)
    return 0


def test_middle_stages_with_two_neighbours_equal_local():
    """On 3 ranks the middle stage exchanges both ways; 1f1b, interleaved and zb-v match local."""
    assert spawn(_three_stage_worker, 3, grace=30, threads=1) == 0


def test_data_parallel_with_and_without_zero_equals_local():
    """On 4 ranks (p=2, dp=2), all-reduce and ZeRO-1 match the local backend, any group source."""
    assert spawn(_data_parallel_worker, 4, grace=30, threads=1) == 0


_KILL_AFTER = 7  # instructions into the second step


def _dying_worker(rank: int, world_size: int, p2p: str) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=5))
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4), data_parallel=2)
    segments = models.mlp_segments(2, width=8)
    engine = Engine(program, segments, F.mse_loss, optimizer, timeout=5, p2p=p2p)
    data = models.TeacherData(width=8)
    if rank == 3:
        calls = []
        run = engine.runtime.run

        def run_then_die(op):
            calls.append(op)
            if len(calls) == len(program.stages[1]) + _KILL_AFTER:
                os.kill(os.getpid(), signal.SIGKILL)
            run(op)

        engine.runtime.run = run_then_die
    for step in range(3):
        x, y = data.batch(8, step)
        engine.train_step(x, y)
    return 0


@pytest.mark.parametrize("p2p", ["shm", "nccl"])
def test_a_killed_rank_ends_every_other_rank_within_the_timeout(capfd, p2p):
    """Rank 3 dies mid-step: the others fail fast, each naming what it waited on; none hangs
    (shared memory, and the NCCL path with NCCL's semantics emulated)."""
    start = time.monotonic()
    code = spawn(_dying_worker, 4, (p2p,), grace=25, threads=1)
    elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    assert code != 0
    assert elapsed < 20, err
    assert "rank 3 was killed by signal 9" in err
    assert "did not stop" not in err, err
    for rank in (0, 1, 2):
        assert f"schedcc: rank {rank}: rank {rank} (stage {rank % 2}) failed" in err, err
    assert "on rank 3 (stage 1)" in err or "data-parallel ranks [1, 3]" in err, err


class _Widen(nn.Module):
    """Stage 0: a cheap, wide output (a message gloo needs a while to carry); raises on its
    second microbatch."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            raise ValueError("the second microbatch")
        return (x * self.scale).repeat(1, 1 << 15)


def _cut_short_worker(rank: int, world_size: int, p2p: str) -> int:
    init(rank, world_size)
    program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 2))
    segments = [_Widen(), nn.Linear(1 << 15, 1)]
    engine = Engine(program, segments, F.mse_loss, optimizer, timeout=30, p2p=p2p)
    x, y = torch.randn(512, 1), torch.randn(512, 1)
    start = time.monotonic()
    with pytest.raises(UserCodeError if rank == 0 else RankFailure) as failure:
        engine.train_step(x, y)
    seconds = time.monotonic() - start
    assert seconds < 10, (rank, seconds, str(failure.value))
    assert "Timed out" not in str(failure.value), failure.value
    return 0


@pytest.mark.parametrize("p2p", ["gloo", "broadcast"])
def test_a_stage_that_fails_mid_send_lets_its_message_finish(p2p):
    """Stage 0 fails just after posting a 64 MiB message: it lets the message finish before it
    ends, so stage 1 reads it whole and then meets the closed socket, within seconds; cut short,
    gloo would have left stage 1's receive waiting for the whole timeout ([Note: a message cut
    short] in `backends.distributed.transfers`)."""
    assert spawn(_cut_short_worker, 2, (p2p,), grace=40, threads=1) == 0


def _stuck_worker(rank: int, world_size: int) -> int:
    if rank == 0:
        return 1  # fails at once
    time.sleep(600)  # never notices
    return 0


def test_a_rank_that_does_not_stop_is_ended_after_the_grace(capfd):
    """spawn waits the grace for the others after a failure, then ends them: never a hang."""
    start = time.monotonic()
    assert spawn(_stuck_worker, 2, grace=1) == 1
    assert time.monotonic() - start < 15
    assert "the other ranks did not stop within 1s after rank 0 failed" in capfd.readouterr().err


def _bound_worker(rank: int, world_size: int) -> int:
    expected = cores_for(rank, world_size)
    if expected is not None and os.sched_getaffinity(0) != expected:
        raise AssertionError(f"rank {rank} runs on {os.sched_getaffinity(0)}, not {expected}")
    return 0


def test_bound_ranks_each_get_their_own_cores():
    """`spawn(bind_cores=True)`: each rank on its own equal slice of the cores, disjoint."""
    assert spawn(_bound_worker, 2, grace=10, bind_cores=True) == 0
    slices = [cores_for(rank, 2) for rank in range(2)]
    if len(os.sched_getaffinity(0)) >= 2:
        assert slices[0]
        assert slices[1]
        assert slices[0].isdisjoint(slices[1])
        assert len(slices[0]) == len(slices[1])
    assert cores_for(0, len(os.sched_getaffinity(0)) + 1) is None  # more ranks than cores


def _uneven_batch_worker(rank: int, world_size: int) -> int:
    """Every rank, whether or not its stage reads the inputs or the targets, refuses a batch that
    does not split into m microbatches, before any exchange (so none waits on another)."""
    init(rank, world_size)
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    engine = Engine(program, models.mlp_segments(2, width=8), F.mse_loss, optimizer, timeout=5)
    x, y = models.TeacherData(width=8).batch(6, 0)
    with pytest.raises(ScheduleConfigError, match="batch 0: 6 samples cannot be split into m=4"):
        engine.train_step(x, y)
    x, y = models.TeacherData(width=8).batch(8, 0)
    assert engine.train_step(x, y) > 0  # the engine is still usable
    return 0


def test_an_uneven_batch_is_refused_on_every_rank():
    assert spawn(_uneven_batch_worker, 2, grace=10, threads=1) == 0
