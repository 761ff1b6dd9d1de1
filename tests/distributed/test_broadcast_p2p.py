"""The distributed engine's new options on gloo: broadcast-pair point-to-point, and clipping,
non-finite skipping and bfloat16 across ranks, equal to the local engine and to non-pipelined
training."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _models import batches, make_segments, mse
from _tied_models import adam, tied_segments
from _tied_models import batches as tied_batches

import schedcc
from schedcc.backends.distributed.engine import Engine
from schedcc.backends.local import Engine as LocalEngine
from schedcc.backends.reference import train_reference
from schedcc.backends.run.launch import spawn
from schedcc.errors import ScheduleConfigError


def _init(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))


def _broadcast_worker(rank: int, world_size: int) -> int:
    _init(rank, world_size)
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    segments = make_segments(2)
    plain = copy.deepcopy(segments)
    data = batches(3, 8)
    engine = Engine(program, segments, mse, adam, timeout=60, p2p="broadcast")
    losses = list(engine.train(data))
    assert engine.point_to_point == "broadcast"
    assert losses == pytest.approx(train_reference(plain, mse, adam, data), abs=1e-10, rel=0)
    for got, want in zip(segments[rank].parameters(), plain[rank].parameters()):
        assert torch.allclose(got, want, atol=1e-10, rtol=0)
    with pytest.raises(ScheduleConfigError, match="p2p must be one of"):
        Engine(program, segments, mse, adam, timeout=60, p2p="carrier-pigeon")
    # bfloat16 over gloo equals the local engine's bfloat16 (same casts, same order)
    low = [segment.float() for segment in make_segments(2)]
    oracle = copy.deepcopy(low)
    data = [(x.float(), y.float()) for x, y in data]
    engine = Engine(program, low, mse, adam, timeout=60, mixed_precision=torch.bfloat16)
    losses = list(engine.train(data))
    local = LocalEngine(program, oracle, mse, adam, mixed_precision=torch.bfloat16)
    assert losses == list(local.train(data))
    for got, want in zip(low[rank].parameters(), oracle[rank].parameters()):
        assert got.dtype == torch.float32
        assert torch.equal(got, want)
    return 0


def test_broadcast_pairs_train_1f1b_as_the_reference():
    """gloo, 1f1b p=2, p2p="broadcast": losses and weights equal non-pipelined training; then
    bfloat16 over gloo equals the local engine's bfloat16 bitwise."""
    assert spawn(_broadcast_worker, 2, grace=60, threads=1) == 0


def _clipping_worker(rank: int, world_size: int) -> int:
    """dp=2 ZeRO-1 with a tied head and embedding: clipping equals clip_grad_norm_ and the local
    engine; then a batch with an inf on one replica is skipped on all four ranks."""
    _init(rank, world_size)
    p, dp = 2, 2
    schedule = schedcc.get_schedule("interleaved-1f1b")(p, 4, 2)
    program = schedcc.compile(schedule, tied=[(0, 3)], data_parallel=dp, zero=1, grad_norm=True)
    segments = tied_segments(4)
    oracle, plain = copy.deepcopy(segments), copy.deepcopy(segments)
    data = tied_batches(3, 8)
    stage, replica = rank % p, rank // p
    engine = Engine(program, segments, mse, adam, timeout=60, max_grad_norm=0.05)
    norms, losses = [], []
    for x, y in data:
        losses.extend(engine.train([(x.chunk(dp)[replica], y.chunk(dp)[replica])]))
        norms.append(engine.last_grad_norm)
    want_norms: list[float] = []
    want = train_reference(plain, mse, adam, data, max_grad_norm=0.05, grad_norms=want_norms)
    local = LocalEngine(program, oracle, mse, adam, max_grad_norm=0.05)
    expected = list(local.train([list(zip(x.chunk(dp), y.chunk(dp))) for x, y in data]))
    assert losses == pytest.approx(want, abs=1e-10, rel=0)
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12
    assert norms == pytest.approx(want_norms, abs=1e-10, rel=1e-10)
    for c in range(2):
        k = schedule.segment_of(stage, c)
        for got, ref in zip(segments[k].parameters(), plain[k].parameters()):
            assert torch.allclose(got, ref, atol=1e-10, rtol=0)
    before = [p.detach().clone() for m in engine.modules for p in m.parameters()]
    x, y = data[0]
    x = x.chunk(dp)[replica].clone()
    if replica == 1:
        x[0, 0] = float("inf")
    list(engine.train([(x, y.chunk(dp)[replica])]))
    assert engine.skipped_steps == 1
    after = [p.detach() for m in engine.modules for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    return 0


def test_clipping_and_skipping_across_four_ranks():
    """gloo, p=2 x dp=2 ZeRO-1, tied: clipping as non-pipelined, one inf skips everywhere."""
    assert spawn(_clipping_worker, 4, grace=60, threads=1) == 0
