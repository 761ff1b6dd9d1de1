"""The messages from one stage to another, in order, and what each is compared with.

[Note: a header only when it changes] A message is a boundary value as flat tensors plus a spec
and a meta (`backends.runtime.boundary.Message`); the receiver learns each message's spec and
meta from a header, which the sender sends only when they differ from those of an earlier
message on the same channel (`backends.distributed.groups.Channel`): the message's *basis*. A
repeated shape sends nothing but the tensors. The receiver must know the basis's spec and meta by
the time it prepares the receive, so the basis is the latest earlier message of the channel that
the receiver has *processed* (read its header or tensors) before it *posts* this one:

- over shared memory a receive is prepared when it is read, after every earlier message of the
  stream, so the basis is simply the previous message of the channel;
- over gloo a receive is posted `RECV_LOOKAHEAD` computes ahead of its consumer, and messages are
  processed in stream order when one of them is waited ([Note: eager point-to-point]), so the
  basis is the latest message of the channel waited, or behind one waited, before the post;
- under NCCL nothing is guessed: what the receiver knows is what an earlier run's message of
  the same channel and input shapes was ([Note: certain shapes] in
  `backends.distributed.peers`), so no stream basis is used.

Both sides compute the same bases from the program and the receiver's plan (every rank holds the
whole program), so they agree without a word; where no message of the channel is processed yet in
this run, the basis is the channel's last message of the previous run, and in the first run,
none (the sender then always sends a header).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

import attrs

from schedcc.backends.distributed.eager import EagerPlan
from schedcc.backends.distributed.groups import Channel, CommGroup, stage_ops
from schedcc.ir import Instruction
from schedcc.program import Program
from schedcc.semantics import Layout

__all__ = ["SHM", "GLOO", "NCCL", "Stream", "receive_streams", "send_streams", "stream_bases"]

#: How a pair of stages exchanges: the basis rule depends on it (see the note above).
SHM, GLOO, NCCL = "shared memory", "gloo", "nccl"
_LATER = float("inf")


@attrs.frozen
class Stream:
    """The messages from one stage to another in one run of the program.

    `ops[n]` is the n-th message's comm op on this side, `channels[n]` its channel and
    `bases[n]` its basis: an index in the same run, `-1 - m` for message `m` of the previous
    run, or None.
    """

    ops: tuple[Instruction, ...]
    channels: tuple[Channel, ...]
    bases: tuple[int | None, ...]

    def basis(self, number: int) -> int | None:
        """The basis of message `number` (counted over every run) as a number, or None."""
        run, n = divmod(number, len(self.ops))
        basis = self.bases[n]
        if basis is None:
            return None
        if basis >= 0:
            return run * len(self.ops) + basis
        return (run - 1) * len(self.ops) + (-1 - basis) if run else None


def stream_bases(
    channels: Sequence[Channel], posted: Sequence[float], waited: Sequence[float]
) -> tuple[int | None, ...]:
    """Each message's basis: the latest earlier message of its channel processed before it is
    posted (`posted[n]`: where message n is posted; `waited[n]`: where it is waited; a message is
    processed when it or a later one is waited), else the channel's last one of the previous run
    (as `-1 - m`), else None.

    >>> stream_bases(["a", "a", "b", "a"], [0, 0, 1, 2], [1, 2, 2, 3])
    (-4, -4, -3, 0)
    """
    count = len(channels)
    done = list(waited)
    for n in range(count - 2, -1, -1):  # processed in stream order: by the first later wait
        done[n] = min(done[n], done[n + 1])
    by_channel: dict[Channel, list[int]] = {}
    for n, channel in enumerate(channels):
        by_channel.setdefault(channel, []).append(n)
    bases: list[int | None] = []
    for n, channel in enumerate(channels):
        earlier = [m for m in by_channel[channel] if m < n]
        # `done` rises along the stream: those done before the post are a prefix of `earlier`
        cut = bisect_left([done[m] for m in earlier], posted[n])
        if cut:
            bases.append(earlier[cut - 1])
        else:
            bases.append(-1 - by_channel[channel][-1])
    return tuple(bases)


def _receives(
    program: Program, layout: Layout, receiver: int, sender: int, kind: str
) -> tuple[list[Instruction], list[Channel], list[float], list[float]]:
    """The receiver's receives from `sender` in order, their channels, and where each is posted
    and waited on the receiver (unit indices)."""
    units = stage_ops(program, receiver, layout)
    ops, channels, where = [], [], []
    for index, unit in enumerate(units):
        if type(unit) is CommGroup:
            for op, peer, channel in unit.recvs:
                if peer == sender:
                    ops.append(op)
                    channels.append(channel)
                    where.append(index)
    if kind in (SHM, NCCL):  # NCCL uses no basis ([Note: certain shapes]): none is planned
        return ops, channels, [_LATER] * len(ops), [float(w) for w in where]
    plan = EagerPlan(units, program.tensors, receiver)
    posted: dict[Instruction, float] = {}
    waited: dict[Instruction, float] = {}
    for index in range(len(units)):
        for op, *_ in plan.post_before[index]:
            posted[op] = index
        for op, *_ in plan.wait_before[index]:
            waited[op] = index
    return ops, channels, [posted[op] for op in ops], [waited[op] for op in ops]


def receive_streams(
    program: Program, layout: Layout, stage: int, kinds: dict[int, str]
) -> dict[int, Stream]:
    """Per peer in `kinds` (peer stage -> SHM, GLOO or NCCL), the stream it sends `stage`."""
    out = {}
    for peer, kind in kinds.items():
        ops, channels, posted, waited = _receives(program, layout, stage, peer, kind)
        if ops:
            bases = stream_bases(channels, posted, waited)
            out[peer] = Stream(tuple(ops), tuple(channels), bases)
    return out


def send_streams(
    program: Program, layout: Layout, stage: int, kinds: dict[int, str]
) -> dict[int, Stream]:
    """Per peer in `kinds`, the stream `stage` sends it: the peer's receives from `stage` (their
    bases), with this stage's sends in their place (a channel is FIFO: the n-th send meets the
    n-th receive)."""
    mine: dict[int, list[Instruction]] = {}
    for unit in stage_ops(program, stage, layout):
        if type(unit) is CommGroup:
            for op, peer, _ in unit.sends:
                mine.setdefault(peer, []).append(op)
    out = {}
    for peer, kind in kinds.items():
        if peer not in mine:
            continue
        _, channels, posted, waited = _receives(program, layout, peer, stage, kind)
        bases = stream_bases(channels, posted, waited)
        out[peer] = Stream(tuple(mine[peer]), tuple(channels), bases)
    return out
