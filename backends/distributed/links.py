"""Two-rank process groups between stages, and point-to-point on them as NCCL runs it.

[Note: one link per direction] NCCL runs the ops of a communicator in the order they are issued,
each to its end: a send ends only once its receive is posted on the peer, and until then every
later op of that communicator waits (on its GPU stream). Ops of one `batch_isend_irecv` run
together, but the batch ends only when all of them have met their partners. Two ops of one
stage that the validator lets meet *different* comm groups of a peer (`F0 [RG0 SA0] B0` against
`[RA0] F0 B0 [SG0]`: the send meets the peer's first group, the receive its second) therefore
cannot share a communicator in that order, and a round that waits for every peer of a comm group
before the next adds a barrier between peers that the validator does not know.

So each *link* (sender stage, receiver stage, lane) gets a process group of its own two ranks,
with its own communicator and stream: on it the sender issues only its sends to that receiver,
in program order, and the receiver only its receives from that sender, in program order. The
n-th send meets the n-th receive (the channel's FIFO pairing, which the validator proves), and a
link waits for nothing but its own earlier ops. Two lanes per direction: `DATA`, whose receives
are posted ahead (`RECV_LOOKAHEAD`), and `SIDE`, for what a receiver can post only once it has
read a header ([Note: certain shapes] in `backends.distributed.peers`). Between links nothing is
ordered, so the relaxations of [Note: eager point-to-point] hold for NCCL as for gloo, and with
them the argument that a validated program cannot hang: every wait is one the rendezvous model
also makes, at the same point of the stage's program or later.

`Links` makes the groups, collectively and in the same order on every rank of the world, for
every replica and every pair of stages that exchange. `LinkIO` moves one tensor on a link:
`dist.isend`/`dist.irecv` on the link's group. Over gloo it can *emulate* NCCL's semantics
(`emulate=True`, what `Engine(..., p2p="nccl")` does on a gloo group): each link of this rank
has a thread that runs its ops one at a time in issue order, as a stream would, and a send ends
only when the receiver has its data (the receiver acknowledges on the same group), so a
protocol that could hang under NCCL hangs here, in CI, on the CPU.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from schedcc.program import Program
from schedcc.semantics import Layout, comm_route

__all__ = ["DATA", "SIDE", "LinkIO", "Links", "exchanging_pairs"]

#: The lanes of a link (see the note).
DATA, SIDE = 0, 1
_ACK_TAG = 1


def exchanging_pairs(program: Program) -> list[tuple[int, int]]:
    """Every (sender stage, receiver stage) pair with a message in `program`, sorted."""
    layout = Layout.of(program.schedule)
    pairs = set()
    for stage, ops in enumerate(program.stages):
        for op in ops:
            if getattr(op, "is_send", False):
                src, dst, _ = comm_route(layout, stage, op)  # type: ignore[misc]
                pairs.add((src, dst))
    return sorted(pairs)


class Links:
    """This rank's two-rank process groups, by (sender stage, receiver stage, lane).

    Collective over the whole world (`dist.new_group` is): every rank makes every replica's
    groups in the same order and keeps its own.
    """

    def __init__(
        self,
        program: Program,
        stage: int,
        pp_group,
        *,
        timeout: timedelta,
        lanes: Iterable[int] = (DATA, SIDE),
        backend: str | None = None,
    ) -> None:
        self.stage = stage
        self._groups: dict[tuple[int, int, int], tuple[Any, int, int]] = {}
        pairs = exchanging_pairs(program)
        mine = dist.get_process_group_ranks(pp_group)
        replicas: list = [None] * dist.get_world_size()
        dist.all_gather_object(replicas, mine)
        lanes = tuple(lanes)
        for replica in sorted({tuple(r) for r in replicas}):
            for a, b in pairs:
                for lane in lanes:
                    group = _group(replica[a], replica[b], lane, timeout, backend)
                    if replica == tuple(mine) and stage in (a, b):
                        self._groups[a, b, lane] = (group, replica[a], replica[b])

    def get(
        self, sender: int, receiver: int, lane: int, *, global_ranks: bool = False
    ) -> tuple[Any, int, int]:
        """The link's group and its sender's and receiver's ranks: in the group, or global."""
        group, a, b = self._groups[sender, receiver, lane]
        if global_ranks:
            return group, a, b
        low = min(a, b)
        return group, int(a != low), int(b != low)


#: Links made in this process, by (world, sender rank, receiver rank, lane, timeout, backend):
#: every rank makes the same engines in the same order, so every rank finds the same ones here
#: and the collective `new_group` calls still match (an evaluation's or a second engine's links
#: are the first's).
_MADE: dict[tuple, Any] = {}


def _group(sender: int, receiver: int, lane: int, timeout: timedelta, backend: str | None):
    key = (id(dist.group.WORLD), sender, receiver, lane, timeout, backend)
    if key not in _MADE:
        _MADE[key] = dist.new_group(sorted({sender, receiver}), timeout=timeout, backend=backend)
    return _MADE[key]


class LinkIO:
    """Sends and receives one tensor on a link of `links`, returning a handle with
    `wait(timeout)`; under NCCL the handle's wait is a stream wait (the host goes on)."""

    def __init__(self, links: Links, stage: int, *, emulate: bool, cuda: bool) -> None:
        self._links = links
        self._stage = stage
        self._emulate = emulate
        self._cuda = cuda

    def send(self, tensor: torch.Tensor, peer: int, lane: int):
        key = (self._stage, peer, lane)
        group, me, other = self._links.get(*key)
        assert me != other
        if self._emulate:
            return _EmulatedLane.of(group, other).submit(tensor, sending=True)
        return _Handle(group.send([tensor], other, 0), self._cuda)

    def recv(self, tensor: torch.Tensor, peer: int, lane: int):
        key = (peer, self._stage, lane)
        group, other, me = self._links.get(*key)
        assert me != other
        if self._emulate:
            return _EmulatedLane.of(group, other).submit(tensor, sending=False)
        return _Handle(group.recv([tensor], other, 0), self._cuda)


class _Handle:
    """A NCCL op's work: `wait` makes the current stream wait for it (no host block); the
    engine's timeout is the link group's own, enforced by the NCCL watchdog."""

    __slots__ = ("_cuda", "_work")

    def __init__(self, work, cuda: bool) -> None:
        self._work = work
        self._cuda = cuda

    def wait(self, timeout=None) -> None:
        if self._cuda:
            self._work.wait()
        else:
            self._work.wait(timeout)


class _EmulatedWork:
    """One op of an emulated link: done once its lane has run it to its end."""

    __slots__ = ("error", "event", "sending", "tensor")

    def __init__(self, tensor: torch.Tensor, sending: bool) -> None:
        self.tensor = tensor
        self.sending = sending
        self.event = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout: timedelta | None = None) -> None:
        seconds = None if timeout is None else timeout.total_seconds()
        if not self.event.wait(seconds):
            what = "send" if self.sending else "receive"
            raise RuntimeError(f"the {what} waited {seconds:g} s for its peer")
        if self.error is not None:
            raise RuntimeError(str(self.error) or type(self.error).__name__) from self.error


class _EmulatedLane:
    """One link of this rank over gloo, run as NCCL runs a communicator's stream: one op at a
    time in issue order, a send ending only when its receiver has the data (acknowledged)."""

    _of: ClassVar[dict[int, _EmulatedLane]] = {}

    @classmethod
    def of(cls, group, other: int) -> _EmulatedLane:
        """The lane of `group` in this process (one thread per link, however many engines)."""
        lane = cls._of.get(id(group))
        if lane is None:
            lane = cls._of[id(group)] = cls(group, other)
        return lane

    def __init__(self, group, other: int) -> None:
        self._group = group
        self._other = other
        self._queue: queue.SimpleQueue[_EmulatedWork] = queue.SimpleQueue()
        self._failed: BaseException | None = None
        threading.Thread(target=self._run, daemon=True, name="schedcc-nccl-lane").start()

    def submit(self, tensor: torch.Tensor, *, sending: bool) -> _EmulatedWork:
        work = _EmulatedWork(tensor, sending)
        self._queue.put(work)
        return work

    def _run(self) -> None:
        ack = torch.zeros(1, dtype=torch.uint8)
        while True:
            work = self._queue.get()
            if self._failed is None:
                try:
                    if work.sending:
                        self._group.send([work.tensor], self._other, 0).wait()
                        self._group.recv([ack], self._other, _ACK_TAG).wait()
                    else:
                        self._group.recv([work.tensor], self._other, 0).wait()
                        self._group.send([ack], self._other, _ACK_TAG).wait()
                except BaseException as exc:  # a peer that died: every later op fails too
                    self._failed = exc
            work.error = self._failed
            work.event.set()
