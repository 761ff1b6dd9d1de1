"""The NCCL point-to-point path (`Engine(..., p2p="nccl")`), run on gloo with NCCL's blocking
semantics emulated ([Note: one link per direction] in `backends/distributed/links.py`): every
built-in trains exactly like the local engine at p = 2, 3 and 4, with the sequence length
changing between steps; the programs that hung the comm-group rounds train; a message's header
travels only for new input shapes, so a steady step reads the host only for its loss, and not
at all with `read_loss=False` ([Note: host syncs]); a boundary whose values decide its shapes is
refused, or sent with `dynamic_shapes`."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import init
from _tied_models import tied_segments
from _written import CLASS_A, written
from strategies import PLAIN_BUILTINS
from torch import nn

import schedcc
from schedcc.backends.distributed.engine import Engine
from schedcc.backends.local import Engine as LocalEngine
from schedcc.backends.run import models
from schedcc.backends.run.launch import spawn
from schedcc.backends.runtime.syncs import HostSyncs
from schedcc.errors import RankFailure, ScheduleConfigError
from schedcc.semantics import Layout
from schedcc.testing import Shape

BUILT_INS = sorted({schedcc.get_schedule(n) for n in PLAIN_BUILTINS}, key=str)
WIDTH = 4


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _shapes(cls, p: int) -> list[Shape]:
    """The shapes of `cls` at p stages this test trains: m from 1 to 2p (the smallest it takes,
    p + 1 and 2p), v of 1 or 2, as the schedule takes them."""
    out = []
    for v in (1, 2):
        taken = [
            shape
            for m in range(1, 2 * p + 1)
            for batches in (1, 2)
            if (shape := Shape(p, m, v, batches)).accepted_by(cls)
        ]
        ms = sorted({s.num_microbatches for s in taken})
        for m in sorted({ms[0], p + 1, 2 * p} & set(ms)) if ms else ():
            out.append(next(s for s in taken if s.num_microbatches == m))
    return out


def _batches(m: int, steps: int, per_run: int) -> list:
    """(inputs, targets) of shape (2m, L, WIDTH): L is 2, then 3 from step 2 on."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for step in range(steps * per_run):
        length = 2 if step < 2 * per_run else 3
        x = torch.randn(2 * m, length, WIDTH, generator=gen)
        out.append((x, torch.tanh(x.flip(-1))))
    return out


def _train_and_compare(rank: int, schedule, *, steps: int = 3, **kwargs) -> Engine:
    """Train `schedule` on the emulated NCCL path and on the local engine; raise on a
    difference in any loss or in this rank's weights."""
    program = schedcc.compile(schedule)
    layout = Layout.of(schedule)
    parts = models.mlp_segments(layout.num_segments // layout.num_replicas, width=WIDTH, seed=1)
    segments = parts * layout.num_replicas  # model replicas (dualpipe) hold the same modules
    oracle = copy.deepcopy(segments)
    batches = _batches(schedule.num_microbatches, steps, schedule.num_batches)
    engine = Engine(program, segments, F.mse_loss, _sgd, timeout=20, p2p="nccl", **kwargs)
    losses = list(engine.train(batches))
    expected = list(LocalEngine(program, oracle, F.mse_loss, _sgd).train(batches))
    where = f"{schedule!r} rank {rank}"
    assert engine.point_to_point in ("nccl (emulated)", "none"), where
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12, (where, losses, expected)
    for c in range(schedule.num_chunks):
        k = schedule.segment_of(engine.stage, c)
        for got, want in zip(segments[k].parameters(), oracle[k].parameters()):
            assert torch.allclose(got, want, rtol=0, atol=1e-12), (where, k)
    return engine


def _built_ins_worker(rank: int, world_size: int) -> int:
    init(rank, world_size)
    for cls in BUILT_INS:
        for shape in _shapes(cls, world_size):
            _train_and_compare(rank, shape.build(cls))
    return 0


@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_built_in_trains_exactly_on_the_nccl_path(p):
    """Every built-in at p stages, m from 1 to 2p, trains on the emulated NCCL path to the local
    engine's losses and weights, while the sequence length changes at step 2."""
    assert spawn(_built_ins_worker, p, grace=30, threads=1) == 0


def _hung_worker(rank: int, world_size: int) -> int:
    init(rank, world_size)
    if world_size == 2:
        _train_and_compare(rank, written(*CLASS_A), steps=2)
    else:
        _train_and_compare(rank, schedcc.get_schedule("interleaved-zb")(3, 2, num_chunks=2))
    return 0


@pytest.mark.parametrize("p", [2, 3], ids=["class-A", "interleaved-zb-p3-m2-v2"])
def test_programs_that_hung_the_comm_group_rounds_train(p):
    """`F0 [RG0 SA0] B0` against `[RA0] F0 B0 [SG0]`, and interleaved-zb p=3 m=2 v=2, whose comm
    groups meet different groups on their peers, train exactly under NCCL's semantics."""
    assert spawn(_hung_worker, p, grace=30, threads=1) == 0


def _syncs_worker(rank: int, world_size: int, tied: bool) -> int:
    init(rank, world_size)
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4), tied=[(0, 1)] if tied else ())
    losses: dict[bool, list] = {}
    for read in (True, False):
        segments = tied_segments(2) if tied else models.mlp_segments(2, width=WIDTH, seed=1)
        engine = Engine(program, segments, F.mse_loss, _sgd, timeout=20, p2p="nccl")
        counts, losses[read] = [], []
        for x, y in _batches(4, 4, 1):
            if tied:
                x, y = x.double(), y.double()
            before = HostSyncs.count
            losses[read].append(engine.train_step(x, y, read_loss=read))
            counts.append(HostSyncs.count - before)
        # steps 0 and 2 bring new input shapes: each of the 4 messages this stage receives
        # reads its header; and a step reads its reduced loss once, or not at all (a tie whose
        # copy here has a gradient reads nothing: [Note: a tie's gradient known here])
        assert counts == ([5, 1, 5, 1] if read else [4, 0, 4, 0]), (read, counts)
    unread = losses[False]
    assert all(t.dtype == torch.float64 and t.dim() == 0 for t in unread), unread
    assert [t.item() for t in unread] == losses[True], (unread, losses[True])
    assert engine.last_metrics["loss"].item() == losses[True][-1]
    return 0


@pytest.mark.parametrize("tied", [False, True], ids=["plain", "tied-head"])
def test_a_steady_step_reads_nothing_on_the_host(tied):
    """On the NCCL path a step whose inputs are shaped like an earlier step's reads the host
    once, for its loss (every message's shapes are certain), and not at all with
    `read_loss=False`, whose device tensors hold the read floats exactly; a step with new
    shapes reads one header per message too. A tied embedding and head add no read."""
    assert spawn(_syncs_worker, 2, (tied,), grace=30, threads=1) == 0


class _Trim(nn.Module):
    """Drops the sequence positions whose first feature is negative in every row: the values
    decide the boundary's shape."""

    def forward(self, x):
        keep = (x[..., 0] >= 0).any(0)
        return x[:, keep] if keep.any() else x[:, :1]


def _valued_worker(rank: int, world_size: int, dynamic: bool) -> int:
    init(rank, world_size)
    schedule = schedcc.get_schedule("gpipe")(2, 2)
    program = schedcc.compile(schedule)
    torch.manual_seed(3)
    segments = [nn.Sequential(nn.Linear(WIDTH, WIDTH), _Trim()), nn.Linear(WIDTH, WIDTH)]
    oracle = copy.deepcopy(segments)
    gen = torch.Generator().manual_seed(9)
    batches = [(torch.randn(4, 6, WIDTH, generator=gen),) * 2 for _ in range(4)]
    batches = [(x, torch.zeros(4, 1, WIDTH)) for x, _ in batches]

    def loss_fn(out, y):
        return (out - y).pow(2).mean()

    engine = Engine(program, segments, loss_fn, _sgd, timeout=5, p2p="nccl", dynamic_shapes=dynamic)
    if dynamic:
        losses = list(engine.train(batches))
        expected = list(LocalEngine(program, oracle, loss_fn, _sgd).train(batches))
        assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12, (losses, expected)
        return 0
    with pytest.raises(RankFailure) as info:
        list(engine.train(batches))
    if rank == 0:  # the sender names the message and the fix
        assert "under p2p='nccl' a boundary's shapes must follow" in str(info.value)
    return 0


@pytest.mark.parametrize("dynamic", [False, True], ids=["refused", "dynamic_shapes"])
def test_a_boundary_whose_values_decide_its_shapes(dynamic):
    """A segment that trims its output by value changes the boundary's shape within a batch and
    between steps: without `dynamic_shapes` the sender refuses it, naming the fix (its peer
    fails within its timeout), with it training equals the local engine."""
    assert spawn(_valued_worker, 2, (dynamic,), grace=30, threads=1) == 0


def _refusal_worker(rank: int, world_size: int) -> int:
    init(rank, world_size)
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    with pytest.raises(ScheduleConfigError, match="p2p must be one of"):
        Engine(program, models.mlp_segments(2, width=WIDTH), F.mse_loss, _sgd, p2p="mpi")
    dist.barrier()  # rank 0 holds the store: no rank leaves while another still uses it
    return 0


def test_an_unknown_transport_is_refused():
    """`p2p` names one of shm, gloo, broadcast, nccl."""
    assert spawn(_refusal_worker, 2, grace=30, threads=1) == 0


def _lane_worker(rank: int, world_size: int) -> int:
    init(rank, world_size)
    from schedcc.backends.distributed.links import DATA, LinkIO, Links

    program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 1))
    io = LinkIO(
        Links(program, rank, dist.group.WORLD, timeout=timedelta(seconds=20)),
        rank,
        emulate=True,
        cuda=False,
    )
    short = timedelta(seconds=0.5)
    if rank == 0:
        first = io.send(torch.ones(3), 1, DATA)
        second = io.send(torch.full((2,), 2.0), 1, DATA)
        with pytest.raises(RuntimeError, match="waited"):
            first.wait(short)  # gloo alone would have buffered it: NCCL waits for the receive
        dist.barrier()  # now rank 1 posts its receives
        first.wait(timedelta(seconds=10))
        second.wait(timedelta(seconds=10))
    else:
        dist.barrier()
        one, two = torch.empty(3), torch.empty(2)
        got = [io.recv(one, 0, DATA), io.recv(two, 0, DATA)]
        for work in got:
            work.wait(timedelta(seconds=10))
        assert one.tolist() == [1.0] * 3
        assert two.tolist() == [2.0] * 2
    return 0


def test_an_emulated_send_ends_only_once_its_receive_is_posted():
    """The emulation is NCCL's, not gloo's: a send waits for its receive, a link's ops meet the
    peer's in issue order."""
    assert spawn(_lane_worker, 2, grace=30, threads=1) == 0
