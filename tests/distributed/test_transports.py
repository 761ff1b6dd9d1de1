"""Random boundary values round-trip through every transport: the local mailbox (a pipeline on
the local backend), shared memory and gloo point-to-point; a header travels only when a message's
spec or meta differ from its basis's ([Note: a header only when it changes])."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from strategies import assert_same, boundary_values
from torch import nn

import schedcc
from schedcc.backends.distributed.links import LinkIO, Links
from schedcc.backends.distributed.peers import GlooPeer, NcclPeer, ShmPeer, Side
from schedcc.backends.distributed.shm import ShmLinks
from schedcc.backends.distributed.streams import Stream, stream_bases
from schedcc.backends.local import Engine
from schedcc.backends.run.launch import spawn
from schedcc.backends.runtime.boundary import activation
from schedcc.ir import RecvActivation

CPU = torch.device("cpu")
#: Each value is sent twice in a row: the second time it repeats its spec and meta.
messages = st.lists(boundary_values(), min_size=1, max_size=4).map(
    lambda values: [v for v in values for _ in range(2)]
)


def _stream(count: int, lookahead: int) -> Stream:
    """`count` messages on one channel, each posted `lookahead` steps before it is waited (step
    n waits message n)."""
    channels = (("A", 0),) * count
    posted = [float(max(0, n - lookahead)) for n in range(count)]
    bases = stream_bases(channels, posted, [float(n) for n in range(count)])
    return Stream(tuple(range(count)), channels, bases)


def _changes(values, stream: Stream) -> int:
    """How many messages differ from their basis (or have none): those that carry a header."""
    metas = [activation(v, segment=0)[0][1:] for v in values]
    return sum(
        1
        for n in range(len(values))
        if (basis := stream.basis(n)) is None or metas[basis] != metas[n]
    )


# -- the local mailbox -----------------------------------------------------------------------------


class _Carry(nn.Module):
    """Segment 0: the input through a linear layer, and `payload` beside it."""

    def __init__(self, payload):
        super().__init__()
        self.linear = nn.Linear(2, 2, dtype=torch.float64)
        self.payload = payload

    def forward(self, x):
        return self.linear(x), self.payload


class _Check(nn.Module):
    """Segment 1: checks it received `payload` as it was sent."""

    def __init__(self, payload):
        super().__init__()
        self.payload = payload

    def forward(self, x, payload):
        assert_same(payload, self.payload)
        return x


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(boundary_values())
def test_values_round_trip_through_the_local_mailbox(payload):
    """A value beside the activation reaches the next stage unchanged, every microbatch."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    segments = [_Carry(payload), _Check(payload)]
    x = torch.randn(4, 2, dtype=torch.float64)
    engine = Engine(program, segments, lambda out, y: ((out - y) ** 2).mean(), torch.optim.SGD)
    assert engine.train_step(x, x) >= 0


# -- shared memory ---------------------------------------------------------------------------------


@given(messages)
def test_values_round_trip_through_shared_memory(values):
    """Sent in order over a shared-memory link, each value comes back unchanged, and headers go
    only with the messages that differ from the previous one."""
    first, second = ShmLinks.pair(timeout=10)
    try:
        stream = _stream(len(values), lookahead=len(values))  # shm: the previous message
        out, into = Side(stream), Side(stream)
        sender, receiver = ShmPeer(first, 1), ShmPeer(second, 0)
        headers = []
        real = first.send_header
        first.send_header = lambda peer, words: (headers.append(words), real(peer, words))
        for n, value in enumerate(values):
            message = activation(value, segment=0)[0]
            sender.send(n, message, out.known(n))
            out.record(n, message)
        for n, value in enumerate(values):
            got = receiver.process(n, into.known(n))
            into.record(n, got)
            assert_same(got.value(), value)
        assert len(headers) == _changes(values, stream)
    finally:
        first.close()
        second.close()


# -- gloo point-to-point ---------------------------------------------------------------------------


def _gloo_round_trips(rank: int) -> None:
    """Both ranks draw the same examples (derandomized); rank 0 sends, rank 1 posts each
    receive ahead as the eager plan does and checks what comes."""
    timeout = timedelta(seconds=20)
    group = dist.group.WORLD

    @settings(
        derandomize=True, database=None, max_examples=30, deadline=None, phases=[Phase.generate]
    )
    @given(messages, st.integers(0, 3))
    def round_trip(values, lookahead):
        stream = _stream(len(values), lookahead)
        side = Side(stream)
        if rank == 0:
            peer, works = GlooPeer(group, 1, torch.device("cpu")), []
            for n, value in enumerate(values):
                message = activation(value, segment=0)[0]
                known = side.known(n)
                sent = peer.send(n, message, known)
                side.record(n, message)
                repeats = known is not None and known[1] and known == message[1:]
                assert len(sent) == len(message.tensors) or not repeats  # nothing extra
                works += sent
            for work, _ in works:
                work.wait(timeout)
        else:
            peer = GlooPeer(group, 0, torch.device("cpu"))
            posted = 0
            for n, value in enumerate(values):
                while posted < len(values) and max(0, posted - lookahead) <= n:
                    peer.post(posted, side.known(posted))
                    posted += 1
                got = peer.process(n, side.known(n), timeout)
                side.record(n, got)
                assert_same(got.value(), value)
        dist.barrier()

    round_trip()


def _nccl_round_trips(rank: int) -> None:
    """The NCCL path's protocol on emulated links ([Note: certain shapes]): a first run sends
    every message's header, a second run of the same values sends their tensors alone; both
    ranks draw the same examples."""
    timeout = timedelta(seconds=20)
    program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 1))
    links = Links(program, rank, dist.group.WORLD, timeout=timeout)
    io = LinkIO(links, rank, emulate=True, cuda=False)

    @settings(
        derandomize=True, database=None, max_examples=20, deadline=None, phases=[Phase.generate]
    )
    @given(messages, st.integers(0, 3))
    def round_trip(values, lookahead):
        ops = tuple(RecvActivation(n) for n in range(len(values)))
        stream = Stream(ops, tuple(("A", n) for n in range(len(values))), (None,) * len(ops))
        side = Side(stream, rule="certain")
        side.begin(None)
        peer = NcclPeer(io, 1 - rank, CPU)
        for run in range(2):
            first = run * len(values)
            if rank == 0:
                works = []
                for n, value in enumerate(values, first):
                    message = activation(value, segment=0)[0]
                    sent = peer.send(n, message, side.known(n))
                    if run:  # the receiver knows every shape: the tensors and nothing else
                        assert len(sent) == sum(t.numel() > 0 for t in message.tensors)
                    side.record(n, message)
                    works += sent
                for work, _ in works:
                    work.wait(timeout)
            else:
                posted = first
                for n, value in enumerate(values, first):
                    while posted < first + len(values) and max(first, posted - lookahead) <= n:
                        peer.post(posted, side.known(posted))
                        posted += 1
                    got = peer.process(n, side.known(n), timeout)
                    side.record(n, got)
                    assert_same(got.value(), value)
            side.finish(run)
        dist.barrier()

    round_trip()


def _gloo_worker(rank: int, world_size: int) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    _gloo_round_trips(rank)
    _nccl_round_trips(rank)
    return 0


def test_values_round_trip_through_gloo_point_to_point():
    """Over gloo, with receives posted ahead shaped like their basis, each value comes back
    unchanged; a message that repeats its basis sends its tensors and nothing else. The NCCL
    path's protocol round-trips them too, on links with NCCL's semantics emulated."""
    assert spawn(_gloo_worker, 2, grace=30, threads=1) == 0
