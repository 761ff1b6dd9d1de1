"""Tied parameters on the distributed backend (gloo, forked processes): each rank trains its own
copy, ReduceTied all-reduces the copies' gradients over the group's ranks, and training equals
the local backend and non-pipelined training of the tied model exactly; a program that does not
tie shared segments is refused on every rank before any weight changes."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _tied_models import adam, batches, mse, tied_segments

import schedcc
from schedcc.backends.distributed.engine import Engine
from schedcc.backends.local import Engine as LocalEngine
from schedcc.backends.reference import train_reference
from schedcc.backends.run.launch import spawn
from schedcc.errors import ScheduleConfigError

#: (schedule, num_chunks, shared memory) trained on two stages.
CASES = [("1f1b", 1, True), ("1f1b", 1, False), ("interleaved-1f1b", 2, True)]


def _init(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))


def _check(
    rank: int, name: str, v: int, dp: int, own: bool, shared_memory: bool, zero: int = 0
) -> None:
    """Train the tied model distributed, locally and without a pipeline from the same weights;
    raise on any difference. `own`: give the engine only this stage's segments."""
    p = 2
    schedule = schedcc.get_schedule(name)(p, 4, v, 3)
    n = schedule.num_segments
    program = schedcc.compile(schedule, tied=[(0, n - 1)], data_parallel=dp, zero=zero)
    segments = tied_segments(n)
    oracle, plain = copy.deepcopy(segments), copy.deepcopy(segments)
    data = batches(3, 8 * dp)
    stage, dp_index = rank % p, rank // p
    mine = [segments[schedule.segment_of(stage, c)] for c in range(v)] if own else segments
    engine = Engine(program, mine, mse, adam, timeout=30, p2p="shm" if shared_memory else "gloo")
    local = [(x.chunk(dp)[dp_index], y.chunk(dp)[dp_index]) for x, y in data]
    losses = list(engine.train(local))
    replicas = [list(zip(x.chunk(dp), y.chunk(dp))) for x, y in data] if dp > 1 else data
    local_engine = LocalEngine(program, oracle, mse, adam)
    expected = list(local_engine.train(replicas))
    reference = train_reference(plain, mse, adam, data, batches_per_run=3)
    where = f"{name} v={v} dp={dp} zero={zero} own={own} shm={shared_memory} rank {rank}"
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12, (where, losses, expected)
    assert losses == pytest.approx(reference, abs=1e-10, rel=1e-10), where
    with engine.unsharded(), local_engine.unsharded():  # whole weights under ZeRO-3
        _compare_weights(engine, schedule, stage, segments, oracle, plain, where)


def _compare_weights(engine, schedule, stage, segments, oracle, plain, where) -> None:
    for c in range(schedule.num_chunks):
        k = schedule.segment_of(stage, c)
        for got, want, ref in zip(
            segments[k].parameters(), oracle[k].parameters(), plain[k].parameters()
        ):
            assert torch.allclose(got, want, rtol=0, atol=1e-12), (where, k)
            assert torch.allclose(got, ref, atol=1e-10, rtol=1e-10), (where, k)
    for _, held in engine.runtime.ties.groups[0]:
        for copy_ in held:  # this rank's copies equal the tied weight of non-pipelined training
            assert torch.allclose(copy_, plain[0].weight, atol=1e-10, rtol=1e-10), where


def _refused(rank: int) -> None:
    """Every rank refuses a program that does not tie the shared segments, before any weight
    changes, naming the parameter, the segments and the fix."""
    schedule = schedcc.get_schedule("1f1b")(2, 4)
    segments = tied_segments(2)
    before = [copy.deepcopy(s.state_dict()) for s in segments]
    with pytest.raises(ScheduleConfigError) as info:
        Engine(schedcc.compile(schedule), segments, mse, adam, timeout=30)
    assert "parameter 'weight' of segment 0" in str(info.value)
    assert "segments [0, 1]" in str(info.value)
    assert "schedcc.compile(..., tied=[(0, 1)])" in str(info.value)
    for segment, state in zip(segments, before):
        for key, value in segment.state_dict().items():
            assert torch.equal(value, state[key])


def _different_copies(rank: int) -> None:
    """Copies that start different on the group's ranks are refused on every rank."""
    schedule = schedcc.get_schedule("1f1b")(2, 4)
    program = schedcc.compile(schedule, tied=[(0, 1)])
    segments = tied_segments(2, seed=rank)  # each rank built the model with its own seed
    with pytest.raises(ScheduleConfigError, match="start with different values"):
        Engine(program, segments, mse, adam, timeout=30)


def _pipeline_worker(rank: int, world_size: int) -> int:
    _init(rank, world_size)
    for name, v, shared_memory in CASES:
        for own in (False, True):
            _check(rank, name, v, 1, own, shared_memory)
    _refused(rank)
    _different_copies(rank)
    return 0


def _data_parallel_worker(rank: int, world_size: int) -> int:
    _init(rank, world_size)
    for name, v, shared_memory in CASES:
        _check(rank, name, v, 2, False, shared_memory)
    _check(rank, "1f1b", 1, 2, True, True)
    _check(rank, "interleaved-1f1b", 2, 2, False, True, zero=3)
    _check(rank, "1f1b", 1, 2, True, False, zero=3)
    return 0


def test_tied_training_on_two_ranks_equals_local_and_non_pipelined():
    """1f1b (shared memory and gloo point-to-point) and interleaved-1f1b, with all segments
    given or only each rank's own (the tie found by value), then the refusals."""
    assert spawn(_pipeline_worker, 2, grace=30, threads=1) == 0


def test_tied_training_with_data_parallelism_equals_local_and_non_pipelined():
    """The same with two data-parallel replicas (four ranks): one tie group per replica; and
    under ZeRO-3, where a tied chunk stays whole until its copies' gradients are summed."""
    assert spawn(_data_parallel_worker, 4, grace=30, threads=1) == 0
