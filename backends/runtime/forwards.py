"""`SegmentForwards`: a segment's forward on one stage, for `StageRuntime`'s `Forward` and
`Recompute` handlers.

A forward applies its chunk's segment (`backends.runtime.segment_calls.SegmentCall`) on the
parameters it runs with (the live ones, a stashed version, or the tied copies), in the stage's
precision (`backends.runtime.precision`), through the user-code guard; on the last segment it
ends in the loss (`backends.runtime.losses`), elsewhere its output leaves as a message
(`backends.runtime.boundary`). A forward its backward waits for leaves a `Graph`
(`backends.runtime.graphs`): the tensors a gradient comes back for, the bytes it saved
(`backends.runtime.memory`), and, for a forward its stage offloads, its saved tensors
(`backends.runtime.offload`). With sequence parts a forward takes the carry the part before it
left and hands its own on (`backends.runtime.carries`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from schedcc.backends.runtime.boundary import Message, activation
from schedcc.backends.runtime.carries import Carries, call_part
from schedcc.backends.runtime.graphs import Graph
from schedcc.backends.runtime.losses import LossBook, StageCounts, call_loss
from schedcc.backends.runtime.memory import SavedBytes, signature
from schedcc.backends.runtime.offload import OffloadedSaved
from schedcc.backends.runtime.ports import Ports
from schedcc.errors import call_user, name_of
from schedcc.ir import Offload

if TYPE_CHECKING:
    from schedcc.backends.runtime.clipping import StageNorm
    from schedcc.backends.runtime.precision import Precision
    from schedcc.backends.runtime.segment_calls import SegmentCall, SegmentClock
    from schedcc.ir import Instruction
    from schedcc.semantics.layout import Layout

__all__ = ["SegmentForwards"]


class SegmentForwards:
    """Applies one stage's segments and ends the last one in the loss.

    Args:
        modules: the segments the stage holds, by chunk.
        calls: how each chunk's segment is applied (`SegmentCall`), by chunk.
        ops: the stage's instructions (which forwards are offloaded).
        layout: which segments start and end a model replica.
        precision: the stage's compute and boundary precision.
        norm: the stage's side of `GradNorm` (float16 backpropagates the scaled loss).
        loss_fn: the user's loss function.
        book, counts, ports, carries: the stage's losses, counts, boundary values and carries.
        num_microbatches: `m`, the microbatches of a batch.
        stashed: whether a forward runs on stashed weights (weight_delay >= 1).
        shadowed: the modules whose tied parameters run as private copies.
        clock: what adds up the time spent in the segments' own work, the user's forward and
            loss ([Note: a compute's own time] in `backends.runtime.segment_calls`).
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        calls: Sequence[SegmentCall],
        ops: Sequence[Instruction],
        *,
        layout: Layout,
        precision: Precision,
        norm: StageNorm,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        book: LossBook,
        counts: StageCounts,
        ports: Ports,
        carries: Carries,
        num_microbatches: int,
        stashed: bool,
        shadowed: Sequence[nn.Module],
        clock: SegmentClock,
    ) -> None:
        self.modules, self._calls, self._layout = modules, calls, layout
        self._clock = clock
        self.precision, self.norm, self.loss_fn = precision, norm, loss_fn
        self._book, self._counts, self._ports, self._carries = book, counts, ports, carries
        self._m, self._delay, self._shadowed = num_microbatches, stashed, shadowed
        self._parts = carries.num_parts
        #: the (microbatch, chunk) whose forwards' saved tensors move to the host and back
        #: ([Note: offloading in the runtime] in `backends.runtime.offload`)
        self._offloaded = {(op.microbatch, op.chunk) for op in ops if type(op) is Offload}
        #: bytes a forward saves, by signature: kept across runs ([Note: activation bytes are
        #: measured once])
        self._saved_bytes = SavedBytes()
        #: whether the run trains (a forward-only run knows no count up front)
        self.training = True

    def run_segment(
        self, c, k, i, value, leaves, params, *, record: bool = True
    ) -> tuple[Graph, Message | None]:
        """Segment k (chunk c) on microbatch i, keeping the graph its backward needs: that
        graph, and the message its output leaves as (None on the last segment)."""
        sent: list[Message] = []
        carry, carry_leaves = self._carries.take(i, c) if self._parts > 1 else (None, [])
        carry_roots: list[torch.Tensor] = []

        def forward() -> list[torch.Tensor]:
            if self._parts > 1:  # [Note: the parts' calling convention]
                out, carried = self.apply_part(c, k, params, value, carry)
                carry_roots.extend(self._carries.hand_on(i, c, k, carried))
            else:
                out = self.apply(c, k, params, value)
            if self._layout.is_last(k):
                return [self.loss(i, out, record=record), *carry_roots]
            message, roots = activation(out, segment=k)
            sent.append(message)
            return roots + carry_roots

        target = self._ports.target(i) if self._layout.is_last(k) else None
        called = (value, carry) if self._parts > 1 else value
        key = signature(c, called, target, training=self.modules[c].training)
        saved = OffloadedSaved(params.values()) if record and (i, c) in self._offloaded else None
        saving = (saved.pack, saved.unpack) if saved is not None else None
        roots, num_bytes = self._saved_bytes.run(key, params.values(), forward, saving=saving)
        graph = Graph(roots, leaves + carry_leaves, list(params.values()), num_bytes, saved)
        graph.carried = (len(carry_roots), len(carry_leaves))
        return graph, (sent[0] if sent else None)

    def apply(self, c: int, k: int, params, value: Any) -> Any:
        """Segment k (chunk c) on `params`, in the stage's precision: its output as it leaves."""
        on = params if self._delay or self.modules[c] in self._shadowed else None  # stashed or tied
        with self.precision.compute(), self._clock:
            out = call_user(self._name(c, k), lambda: self._calls[c](value, on), passing=_LOST_PEER)
        return self.precision.boundary(out, last=self._layout.is_last(k))

    def apply_part(self, c: int, k: int, params, value: Any, carry: Any) -> tuple[Any, Any]:
        """`apply` on one sequence part: `(output, carry)` as they leave ([Note: the parts'
        calling convention] in `backends.runtime.carries`)."""
        module, name = self._module(c, params), self._name(c, k)
        where = name()
        with self.precision.compute(), self._clock:
            out, carried = call_user(
                name, lambda: call_part(module, value, carry, where=where), passing=_LOST_PEER
            )
        boundary = self.precision.boundary
        return boundary(out, last=self._layout.is_last(k)), boundary(carried, last=False)

    def _module(self, c: int, params) -> Any:
        """Chunk c's segment as a callable on `params` (stashed weights or tied copies), or as
        it is."""
        module = self.modules[c]
        if not (self._delay or module in self._shadowed):
            return module

        def on_params(*args: Any, **kwargs: Any) -> Any:
            return torch.func.functional_call(module, params, args, kwargs)

        return on_params

    def _name(self, c: int, k: int) -> Callable[[], str]:
        return lambda: f"the forward of segment {k} ({name_of(self.modules[c])})"

    def deliver(self, i: int, c: int, k: int, out: Any) -> None:
        """The output of a forward that leaves no graph: the loss on the last segment, else
        handed on to the next segment."""
        if self._layout.is_last(k):
            self.loss(i, out)
        else:
            self._ports.hand_on(i, c, k, activation(out, segment=k)[0])

    def loss(self, i: int, out: Any, *, record: bool = True) -> torch.Tensor:
        """`loss_fn` on microbatch i's output: what to backpropagate (`LossBook.objective`;
        `record=False` for a recompute, whose forward already recorded it)."""
        batch, replica = self._counts.key(i)
        if self.training:  # [Note: a count known up front]
            self._counts.know_up_front(batch, self._ports.batch_targets(batch))
        with self._clock:
            result = call_loss(self.loss_fn, out, self._ports.target(i))
        where = f"loss_fn on microbatch {i}"
        objective = self._book.objective(
            batch, result, where=where, record=record, replica=replica, index=i % self._m
        )
        return self.norm.scaled(objective)  # float16: backpropagate the scaled loss


#: What a forward may raise that is no fault of the user's code: a collective inside it (the
#: user's tensor-parallel layers) that lost its peer (see [Note: the user-code guard]).
_LOST_PEER = (torch.distributed.DistError,) if torch.distributed.is_available() else ()
