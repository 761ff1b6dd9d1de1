"""When the gloo path of the distributed `Engine` posts and waits each point-to-point op.

[Note: eager point-to-point] The program places each send/receive pair where the stages meet in
the rendezvous model, which is what the validator proves deadlock-free. A real executor does
better by relaxing that model in three ways, none of which can add a hang:

- a send is posted as soon as the compute that produces its tensor has run, not at its group;
- a receive is posted `RECV_LOOKAHEAD` computes before the one that consumes it, so gloo (which
  moves a message only once both sides have posted it) moves the data while this stage computes;
- a receive is waited only right before the compute that consumes it, not at its group.

Per peer, sends are still posted in program order, and receives too (all receives are posted in
program order), so each receive still pairs with the send the compiler matched it with. A send
never blocks and a receive is waited no earlier than in the rendezvous model, so every stage
gets at least as far as it would there: a program that validates cannot hang. The program's comm
groups then only say in which order messages go; `EagerPlan` says where, per unit.

Computes are the units that are not comm groups (update instructions included); a receive's
consumer is the forward (activation) or the first backward (gradient) of its microbatch and
chunk, a send's producer the same for what it sends, except that the forward of an overlapped
pair (`F3 +B1.1`) runs with its backward, so what it makes is sent after the pair ([Note:
running an overlapped pair] in `backends.runtime.handlers`).
"""

from __future__ import annotations

from collections.abc import Sequence

from schedcc.backends.distributed.groups import CommGroup
from schedcc.ir import Forward, Instruction, OverlappedBackward
from schedcc.semantics import Tensors

__all__ = ["RECV_LOOKAHEAD", "EagerPlan", "Transfer"]

#: Computes ahead of its consumer that a receive is posted (its buffer exists that long): enough
#: for gloo to move the data while this stage computes (docs/performance.md); posting every
#: receive at the start would hold a buffer per microbatch, which defeats 1F1B's memory bound.
RECV_LOOKAHEAD = 4

#: One point-to-point op: `(op, peer stage, shape key, index of its comm group in the units)`.
Transfer = tuple[Instruction, int, tuple[str, int], int]


class EagerPlan:
    """Per unit index: receives to post and to wait before it, sends to post after it.

    Only compute units carry actions; comm groups carry none (see the note above).
    """

    __slots__ = ("post_before", "sends_after", "wait_before")

    def __init__(
        self,
        units: Sequence[Instruction | CommGroup],
        tensors: Tensors,
        stage: int,
        lookahead: int = RECV_LOOKAHEAD,
    ):
        n = len(units)
        self.post_before: list[list[Transfer]] = [[] for _ in range(n)]
        self.wait_before: list[list[Transfer]] = [[] for _ in range(n)]
        self.sends_after: list[list[Transfer]] = [[] for _ in range(n)]
        computes = [i for i, unit in enumerate(units) if type(unit) is not CommGroup]
        # tensor key -> unit index of the first compute that makes or needs it: a sent tensor's
        # producer, a received tensor's consumer (`schedcc.semantics.tensors`)
        position: dict[int, int] = {}
        for index in computes:
            op = units[index]
            assert type(op) is not CommGroup
            made = tensors.makes(stage, op)
            if made is not None:
                position.setdefault(made, _made_at(units, index))
            for key in tensors.needs(stage, op):
                position.setdefault(key, index)
        sends: list[tuple[int, Transfer]] = []  # (producer unit, send), program order
        recvs: list[tuple[int, Transfer]] = []  # (consumer unit, receive), program order
        for g, unit in enumerate(units):
            if type(unit) is not CommGroup:
                continue
            # a validated program (the Engine refuses any other) computes what every comm op
            # sends or receives on this stage
            for op, peer, key in unit.sends:
                sends.append((position[_carried(tensors, stage, op)], (op, peer, key, g)))
            for op, peer, key in unit.recvs:
                recvs.append((position[_carried(tensors, stage, op)], (op, peer, key, g)))
        self._place_sends(sends)
        self._place_recvs(recvs, computes, lookahead)

    def _place_sends(self, sends: list[tuple[int, Transfer]]) -> None:
        """After its producer, and after the previous send to the same peer."""
        last: dict[int, int] = {}
        for producer, send in sends:
            peer = send[1]
            at = max(producer, last.get(peer, -1))
            last[peer] = at
            self.sends_after[at].append(send)

    def _place_recvs(
        self, recvs: list[tuple[int, Transfer]], computes: list[int], lookahead: int
    ) -> None:
        """Waited before its consumer; posted `lookahead` computes earlier, in program order."""
        rank = {index: r for r, index in enumerate(computes)}
        earliest = len(computes)
        posts = []
        for consumer, _ in reversed(recvs):  # no later receive may be posted before this one
            earliest = min(earliest, max(0, rank[consumer] - lookahead))
            posts.append(earliest)
        for (consumer, recv), post in zip(recvs, reversed(posts)):
            self.post_before[computes[post]].append(recv)
            self.wait_before[consumer].append(recv)


def _made_at(units: Sequence[Instruction | CommGroup], index: int) -> int:
    """The unit after which what unit `index` makes exists: its own, or for the forward of an
    overlapped pair the pair's backward, right after it."""
    following = units[index + 1] if index + 1 < len(units) else None
    if type(units[index]) is Forward and type(following) is OverlappedBackward:
        return index + 1
    return index


def _carried(tensors: Tensors, stage: int, op: Instruction) -> int:
    """The key of the tensor a comm op moves (a validated program has one for every comm op)."""
    route = tensors.route(stage, op)
    assert route is not None, op
    return route.tensor
