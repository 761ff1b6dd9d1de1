"""Tensor identity: the one name for each tensor a compute needs or makes and a comm op moves.

[Note: tensor keys] Every tensor that crosses a segment boundary is one int. With `S` segments,
`(i * S + k) * 2` is microbatch i's activation out of segment k (into k + 1) and `+ 1` its input
gradient out of segment k (into k - 1). A key is its microbatch's base `i * 2S` plus an offset
that depends only on the instruction's class, its chunk and its stage, so `Tensors` keeps, per
stage, a table from `(class, chunk)` to offsets: one dict lookup per instruction, no allocation.

- `Forward(i, c)` on segment k needs the activation out of k - 1 (unless k starts its model
  replica, [Note: replicas] in `schedcc.semantics.layout`: k > 0 with one replica) and makes the
  one out of k;
- `Backward` and `BackwardInput` need their forward's activation and the gradient out of k + 1
  (unless k ends its replica) and make the gradient out of k; `BackwardWeight` needs that
  gradient (its `BackwardInput` has run); `Recompute` needs and makes none (it reruns its forward
  on the input that forward kept);
- a send carries what its stage made, a receive what its peer made: `SendActivation` the
  activation out of k, `RecvActivation` the one out of k - 1, `SendGrad` the gradient out of k,
  `RecvGrad` the one out of k + 1. A send and a receive match when they carry the same key.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple

from schedcc.ir import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    OnMicrobatch,
    OverlappedBackward,
    Recompute,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)
from schedcc.semantics.layout import Layout

if TYPE_CHECKING:
    from schedcc.schedule import Schedule

__all__ = ["CommUse", "ComputeUse", "Route", "TensorId", "Tensors", "comm_route", "decode"]


class TensorId(NamedTuple):
    """A key's parts: the gradient out of `segment` or the activation out of it."""

    is_gradient: bool
    microbatch: int
    segment: int


class ComputeUse(NamedTuple):
    """Offsets (add `microbatch * span`) of what a compute needs and makes (-1: nothing);
    `remote` are the needs made on another stage (they arrive by a receive)."""

    needs: tuple[int, ...]
    makes: int
    remote: tuple[int, ...]


class CommUse(NamedTuple):
    """A comm op's channel `(src, dst)` and the offset of the tensor it carries."""

    src: int
    dst: int
    carries: int


class Route(NamedTuple):
    """Where a comm op's tensor goes: from stage `src` to stage `dst`; `tensor` is its key."""

    src: int
    dst: int
    tensor: int


class Tensors:
    """The tensor keys of one layout (see [Note: tensor keys]).

    >>> import schedcc
    >>> from schedcc.ir import RecvGrad, SendActivation
    >>> tensors = Tensors.of(schedcc.get_schedule("gpipe")(2, 4))
    >>> tensors.route(0, SendActivation(3)) == tensors.route(1, schedcc.RecvActivation(3))
    True
    >>> tensors.describe(tensors.route(0, RecvGrad(3)).tensor)
    'input gradient of microbatch 3 out of segment 1'
    """

    __slots__ = ("_comm", "_compute", "_pairs", "layout", "span")

    def __init__(self, layout: Layout):
        self.layout = layout
        self.span = 2 * layout.num_segments  # keys per microbatch
        self._compute = [self._compute_table(s) for s in range(layout.num_stages)]
        self._comm = [self._comm_table(s) for s in range(layout.num_stages)]
        self._pairs = [self._pair_entry(rest) for rest in range(self.span)]

    @classmethod
    def of(cls, schedule: Schedule) -> Tensors:
        return cls(Layout.of(schedule))

    # -- keys ---------------------------------------------------------------------------------

    def activation(self, microbatch: int, segment: int) -> int:
        """The key of microbatch's activation out of `segment`."""
        return microbatch * self.span + 2 * segment

    def gradient(self, microbatch: int, segment: int) -> int:
        """The key of microbatch's input gradient out of `segment` (into segment - 1)."""
        return microbatch * self.span + 2 * segment + 1

    def decode(self, key: int) -> TensorId:
        """The parts of `key`."""
        return decode(key, self.layout.num_segments)

    def describe(self, key: int) -> str:
        is_gradient, microbatch, segment = self.decode(key)
        what = "input gradient" if is_gradient else "activation"
        return f"{what} of microbatch {microbatch} out of segment {segment}"

    def pair_of(self, key: int) -> tuple[tuple[type, int, int], tuple[type, int, int]]:
        """`((send class, microbatch, chunk), (receive class, microbatch, chunk))` moving `key`.

        >>> import schedcc
        >>> tensors = Tensors.of(schedcc.get_schedule("gpipe")(2, 4))
        >>> tensors.pair_of(tensors.gradient(3, 1))
        ((<class 'schedcc.ir.SendGrad'>, 3, 0), (<class 'schedcc.ir.RecvGrad'>, 3, 0))
        """
        microbatch, rest = divmod(key, self.span)
        send, send_chunk, recv, recv_chunk = self._pairs[rest]
        return (send, microbatch, send_chunk), (recv, microbatch, recv_chunk)

    def pair_table(self) -> list[tuple[type, int, type, int]]:
        """`pair_table()[key % span]`: `(send class, its chunk, receive class, its chunk)` that
        move `key` (`pair_of` without building tuples, for a hot loop)."""
        return self._pairs

    def maker_stage(self, key: int) -> int:
        """The stage whose compute makes `key` (its segment's stage)."""
        return self.layout.stage_of[(key % self.span) >> 1]

    # -- per instruction ----------------------------------------------------------------------

    def compute_table(self, stage: int) -> dict[tuple[type, int], ComputeUse]:
        """`(compute class, chunk) -> ComputeUse` for every compute that can run on `stage`."""
        return self._compute[stage]

    def comm_table(self, stage: int) -> dict[tuple[type, int], CommUse]:
        """`(comm class, chunk) -> CommUse` for every comm op with something to move on `stage`."""
        return self._comm[stage]

    def needs(self, stage: int, op: Instruction) -> tuple[int, ...]:
        """The keys a compute needs (empty for anything else)."""
        use = self._compute[stage].get((type(op), getattr(op, "chunk", 0)))
        if use is None or not isinstance(op, OnMicrobatch):
            return ()
        base = op.microbatch * self.span
        return tuple(base + offset for offset in use.needs)

    def makes(self, stage: int, op: Instruction) -> int | None:
        """The key a compute makes, or None."""
        use = self._compute[stage].get((type(op), getattr(op, "chunk", 0)))
        if use is None or use.makes < 0 or not isinstance(op, OnMicrobatch):
            return None
        return op.microbatch * self.span + use.makes

    def route(self, stage: int, op: Instruction) -> Route | None:
        """`(src, dst, tensor)` of a comm op on `stage`, or None if it has nothing to move."""
        use = self._comm[stage].get((type(op), getattr(op, "chunk", 0)))
        if use is None or not isinstance(op, OnMicrobatch):
            return None
        return Route(use.src, use.dst, op.microbatch * self.span + use.carries)

    # -- tables -------------------------------------------------------------------------------

    def _compute_table(self, s: int) -> dict[tuple[type, int], ComputeUse]:
        layout = self.layout
        stage_of = layout.stage_of
        table = {}
        for c, k in enumerate(layout.segment[s]):  # a replica's ends: see [Note: replicas]
            act, grad = 2 * k, 2 * k + 1
            forward_needs = () if layout.is_first(k) else (act - 2,)
            backward_needs = (act,) if layout.is_last(k) else (act, grad + 2)
            for cls, needs, makes in (
                (Forward, forward_needs, act),
                (Backward, backward_needs, grad),
                (BackwardInput, backward_needs, grad),
                (OverlappedBackward, backward_needs, grad),
                (BackwardWeight, (grad,), -1),
            ):
                remote = tuple(o for o in needs if stage_of[o >> 1] != s)
                table[cls, c] = ComputeUse(needs, makes, remote)
            # a recompute reruns its forward on the input that forward kept: it needs and makes
            # no tensor another instruction moves (its place is `schedcc.rules.recompute`'s)
            table[Recompute, c] = ComputeUse((), -1, ())
        return table

    def _pair_entry(self, rest: int) -> tuple[type, int, type, int]:
        k, chunk_of = rest >> 1, self.layout.chunk_of
        if rest & 1:  # the gradient out of segment k, into k - 1
            return (SendGrad, chunk_of[k], RecvGrad, chunk_of[k - 1] if k > 0 else -1)
        return (SendActivation, chunk_of[k], RecvActivation, chunk_of[(k + 1) % len(chunk_of)])

    def _comm_table(self, s: int) -> dict[tuple[type, int], CommUse]:
        layout = self.layout
        stage_of = layout.stage_of
        table = {}
        for c, k in enumerate(layout.segment[s]):
            if not layout.is_last(k) and stage_of[k + 1] != s:
                table[SendActivation, c] = CommUse(s, stage_of[k + 1], 2 * k)
                table[RecvGrad, c] = CommUse(stage_of[k + 1], s, 2 * k + 3)
            if not layout.is_first(k) and stage_of[k - 1] != s:
                table[RecvActivation, c] = CommUse(stage_of[k - 1], s, 2 * k - 2)
                table[SendGrad, c] = CommUse(s, stage_of[k - 1], 2 * k + 1)
        return table


def decode(key: int, num_segments: int) -> TensorId:
    """The parts of tensor `key` in a program of `num_segments` segments.

    >>> decode(2 * (3 * 4 + 1) + 1, 4)
    TensorId(is_gradient=True, microbatch=3, segment=1)
    """
    microbatch, rest = divmod(key, 2 * num_segments)
    return TensorId(bool(rest & 1), microbatch, rest >> 1)


def comm_route(layout: Layout, stage: int, op: Instruction) -> Route | None:
    """`Tensors(layout).route(stage, op)`, keeping the tables of the last few layouts: for a
    caller that holds a `Layout` and routes a few ops (a backend setting up a stage).

    >>> import schedcc
    >>> layout = Layout.of(schedcc.get_schedule("gpipe")(2, 4))
    >>> comm_route(layout, 0, SendActivation(3))
    Route(src=0, dst=1, tensor=12)
    """
    return _tensors_of(layout).route(stage, op)


@lru_cache(maxsize=8)
def _tensors_of(layout: Layout) -> Tensors:
    return Tensors(layout)
