"""Helpers of the tests that start gloo ranks: the process-group setup, and training one program
on the distributed engine and on the local one from the same weights."""

from __future__ import annotations

import copy
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

import schedcc
from schedcc.backends.distributed.engine import Engine
from schedcc.backends.distributed.groups import CommGroup
from schedcc.backends.distributed.shm import host_key
from schedcc.backends.local import Engine as LocalEngine
from schedcc.backends.run import models
from schedcc.ir import RECEIVES

__all__ = ["compare", "compare_program", "init", "optimizer"]

def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def init(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))


def compare(rank, name, p, v, batches_per_run, steps, dp=1, zero=0, linked=True, **kwargs):
    """Train one program distributed and locally from the same weights; raise on a difference.

    `linked`: whether neighbouring stages should exchange through shared memory (all ranks run on
    this machine) rather than gloo.
    """
    schedule = schedcc.get_schedule(name)(p, 4, v, batches_per_run)
    compare_program(rank, schedule, steps, dp=dp, zero=zero, linked=linked, **kwargs)


def compare_program(rank, schedule, steps, dp=1, zero=0, linked=True, **kwargs):
    """`compare` for any schedule (e.g. a hand-written program)."""
    p, v, m = schedule.num_stages, schedule.num_chunks, schedule.num_microbatches
    program = schedcc.compile(schedule, data_parallel=dp, zero=zero)
    segments = models.mlp_segments(p * v, width=8, seed=1)
    oracle = copy.deepcopy(segments)
    data = models.TeacherData(width=8, seed=2)
    batches = [data.batch(2 * m * dp, step) for step in range(steps)]
    dp_index = rank // p
    local = [(x.chunk(dp)[dp_index], y.chunk(dp)[dp_index]) for x, y in batches]
    engine = Engine(program, segments, F.mse_loss, optimizer, timeout=30, **kwargs)
    losses = list(engine.train(local))
    peers = {s for op in engine._ops if type(op) is CommGroup for s in op.peers}
    shm_peers = engine._transfers.shm_peers
    assert shm_peers == (peers if linked and host_key() else set()), shm_peers
    replicas = [list(zip(x.chunk(dp), y.chunk(dp))) for x, y in batches] if dp > 1 else batches
    expected = list(LocalEngine(program, oracle, F.mse_loss, optimizer).train(replicas))
    where = f"{schedule!r} dp={dp} zero={zero} rank {rank}"
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12, (where, losses, expected)
    traced = [op for _, op, _, _ in engine.trace_events()]
    assert traced == list(program.stages[engine.stage]), where  # each instruction once, in order
    owns = []  # a compute's own time (a pair's forward, held back to its backward: none)
    takes = []  # a receive's take, its group's shared among its receives
    for _, op, start, end, own in engine.trace_events(own=True):
        receives = type(op) in RECEIVES
        assert (own is not None) == (op.group == "compute" or receives), (where, op)
        assert own is None or 0 <= own <= end - start, (where, op, own, end - start)
        (takes if receives else owns).append(own or 0.0)
    assert sum(owns) > 0, where
    assert not takes or sum(takes) > 0, where  # taking a message costs its stage something
    assert engine.current_instruction is None, where  # between runs it waits on nothing
    for c in range(v):
        k = schedule.segment_of(engine.stage, c)
        for got, want in zip(segments[k].parameters(), oracle[k].parameters()):
            assert torch.allclose(got, want, rtol=0, atol=1e-12), (where, k)
