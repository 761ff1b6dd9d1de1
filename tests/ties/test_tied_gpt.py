"""The GPT of `schedcc.backends.run.gpt` (tuple boundaries with a bool padding mask and int
position ids, LM head tied to the token embedding, a `(loss_sum, count)` loss), Adam, float64,
three batches of different sequence lengths: equal to non-pipelined training of the same model
on the local backend for every built-in schedule, and on gloo for 1f1b and interleaved."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import schedcc
from schedcc.backends.distributed.engine import Engine as DistributedEngine
from schedcc.backends.local import Engine
from schedcc.backends.reference import train_reference
from schedcc.backends.run.gpt import GPT, GPTConfig, PaddedBigramData, gpt_segments, token_loss
from schedcc.backends.run.launch import spawn
from schedcc.errors import ScheduleConfigError

SCHEDULES = [
    ("gpipe", {}),
    ("1f1b", {}),
    ("interleaved-1f1b", {"num_chunks": 2}),
    ("zb-h1", {}),
    ("zb-v", {"num_chunks": 2}),
    ("2bw", {}),
]


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def _model() -> GPT:
    config = GPTConfig(vocab=16, max_len=8, d_model=8, num_heads=2, num_blocks=4)
    return GPT(config, seed=0).double()


def _batches(dp: int = 1):
    data = PaddedBigramData(vocab=16, max_len=8, seed=3)
    out = [data.batch(4 * dp, step) for step in range(3)]
    assert len({tokens.shape[1] for (tokens, _), _ in out}) > 1  # the lengths change
    return out


def _reference(segments, schedule, data):
    plain = copy.deepcopy(segments)
    losses = train_reference(
        plain,
        token_loss,
        _adam,
        data,
        weight_delay=schedule.weight_delay,
        batches_per_run=schedule.num_batches,
    )
    return plain, losses


@pytest.mark.parametrize(("name", "kwargs"), SCHEDULES)
def test_the_tied_gpt_trains_like_non_pipelined(name, kwargs):
    """Every built-in schedule on two stages, the first and last segment sharing the embedding:
    equal to the non-pipelined GPT to 1e-10."""
    schedule = schedcc.get_schedule(name)(2, 2, num_batches=3, **kwargs)
    n = schedule.num_segments
    segments = gpt_segments(_model(), n)
    assert segments[0].tok.weight is segments[-1].head.weight
    plain, expected = _reference(segments, schedule, _batches())
    program = schedcc.compile(schedule, tied=[(0, n - 1)])
    losses = list(Engine(program, segments, token_loss, _adam).train(_batches()))
    assert losses == pytest.approx(expected, abs=1e-10, rel=1e-10)
    for k, (mine, theirs) in enumerate(zip(segments, plain)):
        for (name_, p), q in zip(mine.named_parameters(), theirs.parameters()):
            assert torch.allclose(p, q, atol=1e-10, rtol=1e-10), (k, name_)


def test_the_gpt_without_tied_is_refused():
    """Its head is its embedding: a program that does not tie them is refused with the fix."""
    segments = gpt_segments(_model(), 2)
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    with pytest.raises(ScheduleConfigError, match=r"tied=\[\(0, 1\)\]"):
        Engine(program, segments, token_loss, _adam)


def _gloo_worker(rank: int, world_size: int) -> int:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    dp = world_size // 2
    cases = (("1f1b", 1, True), ("1f1b", 1, False), ("interleaved-1f1b", 2, True))
    for name, v, shared_memory in cases:
        schedule = schedcc.get_schedule(name)(2, 2, v, 3)
        n = schedule.num_segments
        program = schedcc.compile(schedule, tied=[(0, n - 1)], data_parallel=dp)
        segments = gpt_segments(_model(), n)
        data = _batches(dp)
        plain, expected = _reference(segments, schedule, data)
        r = rank // 2
        local = [((t.chunk(dp)[r], m.chunk(dp)[r]), y.chunk(dp)[r]) for (t, m), y in data]
        engine = DistributedEngine(
            program, segments, token_loss, _adam, timeout=30, p2p="shm" if shared_memory else "gloo"
        )
        losses = list(engine.train(local))
        assert losses == pytest.approx(expected, abs=1e-10, rel=1e-10), (name, rank, losses)
        for c in range(v):
            k = schedule.segment_of(rank % 2, c)
            for p, q in zip(segments[k].parameters(), plain[k].parameters()):
                assert torch.allclose(p, q, atol=1e-10, rtol=1e-10), (name, rank, k)
    return 0


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_tied_gpt_on_gloo_trains_like_non_pipelined(world_size):
    """1f1b (shared memory and gloo point-to-point) and interleaved-1f1b, dp = 1 and 2."""
    assert spawn(_gloo_worker, world_size, grace=30, threads=1) == 0
