"""Data only where needed on the distributed engine ([Note: data only where needed] in
`backends/distributed/engine.py`): the first stage reads inputs, the last reads targets, every
other rank may pass None; training (and evaluation) is then exactly the local engine's, on the
default transport and on the (emulated) NCCL path, whose ranks without inputs take the input
signatures from the first stage while the shapes change between steps. A bad batch seen only
where its data is is refused on every rank alike."""

from __future__ import annotations

import copy
import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import schedcc
from schedcc.backends.distributed.engine import Engine
from schedcc.backends.local import Engine as LocalEngine
from schedcc.backends.run import models
from schedcc.backends.run.launch import spawn
from schedcc.errors import ScheduleConfigError

WIDTH = 4


def _init(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _batches(m: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) of shape (2m, L, WIDTH): L is 2, then 3 from step 2 on (new shapes
    for the NCCL path's signatures)."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for step in range(steps):
        x = torch.randn(2 * m, 2 if step < 2 else 3, WIDTH, generator=gen)
        out.append((x, torch.tanh(x.flip(-1))))
    return out


def _mine(engine: Engine, x, y):
    """What this rank passes: inputs only on the first stage, targets only on the last."""
    first, last = engine.stage == 0, engine.stage == engine.program.num_stages - 1
    return (x if first else None, y if last else None)


def _summed(out, y):
    """A `(loss_sum, count)` loss: the summed squared error over the positive targets only
    (their count is known only on the last stage and travels with the gradients)."""
    keep = y > 0
    return ((out - y) ** 2 * keep).sum(), keep.sum()


def _where_needed_worker(rank: int, world_size: int, p2p: str | None, loss_fn) -> int:
    _init(rank, world_size)
    schedule = schedcc.get_schedule("1f1b")(world_size, 3)
    program = schedcc.compile(schedule)
    segments = models.mlp_segments(world_size, width=WIDTH, seed=1)
    oracle = copy.deepcopy(segments)
    batches = _batches(3, 4)
    engine = Engine(program, segments, loss_fn, _sgd, timeout=20, p2p=p2p)
    mine = [_mine(engine, x, y) for x, y in batches]
    losses = list(engine.train(mine[:2]))  # the first stage's batches are (x, None)
    losses += [engine.train_step(*batch) for batch in mine[2:]]  # the middle's (None, None)
    local = LocalEngine(program, oracle, loss_fn, _sgd)
    expected = list(local.train(batches))
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12, (rank, losses, expected)
    k = engine.stage
    for got, want in zip(segments[k].parameters(), oracle[k].parameters()):
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (rank, k)
    x, y = batches[-1]
    loss = engine.evaluate(*_mine(engine, x, y))
    assert abs(loss - local.evaluate(x, y)) < 1e-12, rank
    out = engine.predict(_mine(engine, x, y)[0])
    if engine.stage == world_size - 1:
        assert torch.allclose(out, local.predict(x), rtol=0, atol=1e-12)
    else:
        assert out is None
    dist.destroy_process_group()
    return 0


@pytest.mark.parametrize(
    ("p2p", "loss_fn"),
    [(None, F.mse_loss), ("nccl", F.mse_loss), (None, _summed)],
    ids=["default", "nccl-emulated", "loss-sum-count"],
)
def test_each_rank_given_only_what_its_stage_reads_trains_exactly(p2p, loss_fn):
    """At p = 3 the first stage passes (x, None), the middle (None, None) and the last
    (None, y), through `train` and `train_step`, with the sequence length changing at step 2:
    losses, weights, `evaluate` and `predict` equal the local engine's given whole batches,
    for a mean loss and a `(loss_sum, count)` one."""
    assert spawn(_where_needed_worker, 3, (p2p, loss_fn), grace=30, threads=1) == 0


def _refused_worker(rank: int, world_size: int, p2p: str | None, where: str) -> int:
    _init(rank, world_size)
    program = schedcc.compile(schedcc.get_schedule("1f1b")(world_size, 4))
    segments = models.mlp_segments(world_size, width=WIDTH, seed=1)
    engine = Engine(program, segments, F.mse_loss, _sgd, timeout=20, p2p=p2p)
    x, y = _batches(4, 1)[0]
    before = [p.detach().clone() for p in engine.modules[0].parameters()]
    if where == "size":  # 7 samples on the first stage only: m = 4 does not divide them
        bad, text = _mine(engine, x[:7], y), "batch 0: 7 samples cannot be split into m=4"
    else:  # the first stage passes no inputs
        bad, text = (None, None) if rank == 0 else _mine(engine, x, y), "batch 0: inputs are None"
    # the first stage raises its own error; every other rank names it
    text = re.escape(text) if rank == 0 else re.escape(f"rank 0 (stage 0): {text}")
    with pytest.raises(ScheduleConfigError, match=f"^{text}"):
        engine.train_step(*bad)
    assert engine.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, engine.modules[0].parameters()))
    engine.train_step(*_mine(engine, x, y))  # and the engine trains on after
    assert engine.steps == 1
    dist.destroy_process_group()
    return 0


@pytest.mark.parametrize(
    ("p2p", "where"),
    [(None, "size"), ("nccl", "size"), (None, "no-inputs")],
    ids=["size-default", "size-nccl-emulated", "no-inputs"],
)
def test_a_bad_batch_on_the_first_stage_is_refused_on_every_rank(p2p, where):
    """A batch that only the first stage holds, and m does not divide (or no inputs where
    they are read), is refused on every rank before anything runs: the first stage raises its
    own error, the others name rank 0 and say it; the engines then train on."""
    assert spawn(_refused_worker, 3, (p2p, where), grace=30, threads=1) == 0
