"""Boundaries that carry no gradient ([Note: nothing to send] in
`backends/distributed/peers.py`): a frozen first segment, a first segment without parameters, a
segment that detaches its output. Their gradient messages hold no tensor; every transport
(shared memory, gloo, broadcast, NCCL's protocol) moves them as it moves any other message, and
every built-in at p = 2 trains exactly like the local engine, batch after batch."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from strategies import PLAIN_BUILTINS
from torch import nn

import schedcc
from schedcc.backends.distributed.engine import Engine
from schedcc.backends.local import Engine as LocalEngine
from schedcc.backends.run.launch import spawn
from schedcc.semantics import Layout
from schedcc.testing import Shape

BUILT_INS = sorted({schedcc.get_schedule(n) for n in PLAIN_BUILTINS}, key=str)
TRANSPORTS = ("shm", "gloo", "broadcast", "nccl")
WIDTH = 4


class _Detach(nn.Module):
    """A linear layer whose output takes no gradient: nothing flows back through it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.linear(x).detach()


def _segments(kind: str, count: int) -> list[nn.Module]:
    """`count` segments whose boundary after the first (or, detaching, after the middle one)
    takes no gradient."""
    torch.manual_seed(1)
    out = [nn.Linear(WIDTH, WIDTH) for _ in range(count)]
    if kind == "frozen":
        out[0].requires_grad_(False)
    elif kind == "parameter-free":
        out[0] = nn.Tanh()
    else:
        out[max(0, count // 2 - 1)] = _Detach()
    return out


def _shape(cls) -> Shape:
    """The smallest shape of `cls` at p = 2 with at least 2 microbatches."""
    return next(
        shape
        for m in (2, 4)
        for v in (1, 2)
        for batches in (1, 2)
        if (shape := Shape(2, m, v, batches)).accepted_by(cls)
    )


def _worker(rank: int, world_size: int, kind: str) -> int:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    gen = torch.Generator().manual_seed(2)
    for cls in BUILT_INS:
        schedule = _shape(cls).build(cls)
        program = schedcc.compile(schedule)
        layout = Layout.of(schedule)
        parts = _segments(kind, layout.num_segments // layout.num_replicas)
        m, per_run = schedule.num_microbatches, schedule.num_batches
        batches = [
            (torch.randn(2 * m, WIDTH, generator=gen), torch.randn(2 * m, WIDTH, generator=gen))
            for _ in range(2 * per_run)
        ]
        expected = list(
            LocalEngine(
                program, copy.deepcopy(parts) * layout.num_replicas, F.mse_loss, _sgd
            ).train(batches)
        )
        for p2p in TRANSPORTS:
            segments = copy.deepcopy(parts) * layout.num_replicas
            engine = Engine(program, segments, F.mse_loss, _sgd, timeout=10, p2p=p2p)
            losses = list(engine.train(batches))
            where = f"{kind} {schedule!r} p2p={p2p} rank {rank}"
            assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12, (where, losses)
    return 0


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("kind", ["frozen", "parameter-free", "detaching"])
def test_a_boundary_without_gradients_trains_on_every_transport(kind):
    """Every built-in at p = 2, on shared memory, gloo, broadcast and NCCL's protocol, trains
    two batches to the local engine's losses."""
    assert spawn(_worker, 2, (kind,), grace=20, threads=1) == 0
