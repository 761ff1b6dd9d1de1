"""What one stage holds at its segments' boundaries during a run, for `StageRuntime`.

Per microbatch: the batch's inputs (segment 0) and targets (the last segment), the messages
received (`incoming`) and those waiting to be sent (`outgoing`), and the messages handed from one
segment to the next on the same stage, which never leave it. Keys: `("A", i, c)` is the
activation out of chunk c's segment, `("G", i, c)` the gradient out of it; hand-overs are keyed
by segment instead, since both ends are on this stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from schedcc.backends.runtime.boundary import Message, detached, receive
from schedcc.backends.runtime.values import TensorMeta, flatten
from schedcc.errors import RuntimeInstructionError
from schedcc.ir import Instruction, RecvActivation, RecvGrad, SendActivation, SendGrad

__all__ = ["Ports"]


class Ports:
    """The boundary values of one stage for one run (see the module docstring).

    Args:
        stage: the stage.
        stage_of: the stage of each segment (`Layout.stage_of`).
        num_microbatches: `m`.
    """

    def __init__(self, stage: int, stage_of: Sequence[int], num_microbatches: int) -> None:
        self.stage = stage
        self._stage_of = stage_of
        self._m = num_microbatches
        self.reset()

    def reset(self) -> None:
        """A new run: nothing held."""
        self._batch_inputs: dict[int, Sequence[Any]] = {}
        self._batch_targets: dict[int, Sequence[Any]] = {}
        self._received: dict[tuple[str, int, int], Any] = {}
        self._to_send: dict[tuple[str, int, int], Message] = {}
        self._handoff: dict[tuple[str, int, int], Message] = {}

    # -- the batch ------------------------------------------------------------------------------

    def load_batch(self, batch: int, inputs: Sequence[Any] | None, targets: Sequence[Any] | None):
        """The microbatches of `batch`'s inputs and targets (either may be None)."""
        if inputs is not None:  # detached: a backward stops at the batch (no graph behind it)
            self._batch_inputs[batch] = [detached(x) for x in inputs]
        if targets is not None:
            self._batch_targets[batch] = list(targets)

    def has_targets(self, microbatch: int) -> bool:
        """Whether targets were loaded for `microbatch`'s batch."""
        return microbatch // self._m in self._batch_targets

    def target(self, microbatch: int) -> Any:
        """The targets of `microbatch`."""
        batch, local = divmod(microbatch, self._m)
        return self._batch_targets[batch][local]

    # -- the backend's side ---------------------------------------------------------------------

    def outgoing(self, op: Instruction) -> Message:
        """The message a `SendActivation` or `SendGrad` sends."""
        if type(op) is SendActivation:
            key = ("A", op.microbatch, op.chunk)
        elif type(op) is SendGrad:
            key = ("G", op.microbatch, op.chunk)
        else:
            raise RuntimeInstructionError(
                f"StageRuntime.outgoing (stage {self.stage}) got {op}: only SendActivation and "
                "SendGrad send a tensor",
                stage=self.stage,
            )
        if key not in self._to_send:
            raise RuntimeInstructionError(
                f"stage {self.stage}: {op} has nothing to send yet (its compute has not run)",
                stage=self.stage,
            )
        return self._to_send.pop(key)

    def incoming(self, op: Instruction, message: Message | Any) -> None:
        """Take what a `RecvActivation` or `RecvGrad` received: a `Message`, or a bare value
        (whose floating tensors then all take a gradient)."""
        if type(op) not in (RecvActivation, RecvGrad):
            raise RuntimeInstructionError(
                f"StageRuntime.incoming (stage {self.stage}) got {op}: only RecvActivation and "
                "RecvGrad receive a tensor",
                stage=self.stage,
            )
        if not isinstance(message, Message):
            tensors, spec = flatten(message, name=str(op))
            takes = [t.is_floating_point() for t in tensors]
            meta = tuple(TensorMeta(t.dtype, tuple(t.shape), g) for t, g in zip(tensors, takes))
            message = Message(tensors, spec, meta)
        if type(op) is RecvActivation:
            self._received["A", op.microbatch, op.chunk] = receive(message)
        else:
            self._received["G", op.microbatch, op.chunk] = message

    # -- the runtime's side ---------------------------------------------------------------------

    def input_of(self, i: int, c: int, k: int) -> tuple[Any, list[torch.Tensor]]:
        """The value segment k (chunk c) is called on for microbatch i, and its leaves that
        take a gradient."""
        if k == 0:
            batch, local = divmod(i, self._m)
            return self._batch_inputs[batch][local], []
        if self._stage_of[k - 1] == self.stage:
            return receive(self._handoff.pop(("A", i, k - 1)))
        return self._take(("A", i, c), "activation")

    def hand_on(self, i: int, c: int, k: int, message: Message) -> None:
        """Segment k's output for microbatch i: to the next segment here, or to send."""
        if self._stage_of[k + 1] == self.stage:
            self._handoff["A", i, k] = message
        else:
            self._to_send["A", i, c] = message

    def gradient_of(self, i: int, c: int, k: int) -> Message:
        """The gradient message for segment k's output (from segment k + 1)."""
        if self._stage_of[k + 1] == self.stage:
            return self._handoff.pop(("G", i, k + 1))
        return self._take(("G", i, c), "gradient")

    def hand_back(self, i: int, c: int, k: int, message: Message) -> None:
        """Segment k's input gradient for microbatch i: to segment k - 1 here, or to send."""
        if self._stage_of[k - 1] == self.stage:
            self._handoff["G", i, k] = message
        else:
            self._to_send["G", i, c] = message

    def _take(self, key: tuple[str, int, int], what: str) -> Any:
        if key not in self._received:
            _, i, c = key
            raise RuntimeInstructionError(
                f"stage {self.stage}: microbatch {i} chunk {c} needs a received {what} that has "
                "not arrived; the program must receive it before the compute",
                stage=self.stage,
            )
        return self._received.pop(key)
