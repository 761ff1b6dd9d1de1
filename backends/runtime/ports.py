"""What one stage holds at its segments' boundaries during a run, for `StageRuntime`.

Per microbatch: the batch's inputs (segment 0) and targets (the last segment), the messages
received (`incoming`) and those waiting to be sent (`outgoing`), and the messages handed from one
segment to the next on the same stage, which never leave it. Each is keyed by the tensor's one
name, its key in `schedcc.semantics.tensors` (the activation or input gradient of a microbatch
out of a segment), the name the compiler and the validator pair sends and receives by.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from schedcc.backends.runtime.boundary import Message, detached, read_gradients, receive
from schedcc.backends.runtime.values import TensorMeta, flatten
from schedcc.errors import RuntimeInstructionError
from schedcc.ir import Instruction, RecvActivation, RecvGrad, SendActivation, SendGrad
from schedcc.semantics import Tensors

__all__ = ["Ports"]


class Ports:
    """The boundary values of one stage for one run (see the module docstring).

    Args:
        stage: the stage.
        tensors: the program's tensor keys (`program.tensors`).
        num_microbatches: `m`.
    """

    def __init__(self, stage: int, tensors: Tensors, num_microbatches: int) -> None:
        self.stage = stage
        self._tensors = tensors
        self._stage_of = tensors.layout.stage_of
        self._m = num_microbatches
        self.reset()

    def reset(self) -> None:
        """A new run: nothing held."""
        self._batch_inputs: dict[int, Sequence[Any]] = {}
        self._batch_targets: dict[int, Sequence[Any]] = {}
        self._received: dict[int, Any] = {}
        self._to_send: dict[int, Message] = {}
        self._handoff: dict[int, Message] = {}

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

    def batch_targets(self, batch: int) -> Sequence[Any]:
        """The targets of every microbatch of `batch`, in order."""
        return self._batch_targets[batch]

    def target(self, microbatch: int) -> Any:
        """The targets of `microbatch`."""
        batch, local = divmod(microbatch, self._m)
        return self._batch_targets[batch][local]

    # -- the backend's side ---------------------------------------------------------------------

    def outgoing(self, op: Instruction) -> Message:
        """The message a `SendActivation` or `SendGrad` sends."""
        route = self._tensors.route(self.stage, op)
        if type(op) not in (SendActivation, SendGrad) or route is None:
            raise RuntimeInstructionError(
                f"StageRuntime.outgoing (stage {self.stage}) got {op}: only a SendActivation or "
                "SendGrad to another stage sends a tensor",
                stage=self.stage,
            )
        key = route.tensor
        if key not in self._to_send:
            raise RuntimeInstructionError(
                f"stage {self.stage}: {op} has nothing to send yet (its compute has not run)",
                stage=self.stage,
            )
        return self._to_send.pop(key)

    def incoming(self, op: Instruction, message: Message | Any) -> None:
        """Take what a `RecvActivation` or `RecvGrad` received: a `Message`, or a bare value
        (whose floating tensors then all take a gradient)."""
        route = self._tensors.route(self.stage, op)
        if type(op) not in (RecvActivation, RecvGrad) or route is None:
            raise RuntimeInstructionError(
                f"StageRuntime.incoming (stage {self.stage}) got {op}: only a RecvActivation or "
                "RecvGrad from another stage receives a tensor",
                stage=self.stage,
            )
        if not isinstance(message, Message):
            tensors, spec = flatten(message, name=str(op))
            takes = [t.is_floating_point() for t in tensors]
            meta = tuple(TensorMeta(t.dtype, tuple(t.shape), g) for t, g in zip(tensors, takes))
            message = Message(tensors, spec, meta)
        if type(op) is RecvActivation:
            self._received[route.tensor] = receive(message)
        else:
            self._received[route.tensor] = message

    # -- the runtime's side ---------------------------------------------------------------------

    def input_of(self, i: int, c: int, k: int) -> tuple[Any, list[torch.Tensor]]:
        """The value segment k (chunk c) is called on for microbatch i, and its leaves that
        take a gradient."""
        if self._tensors.layout.is_first(k):  # a replica's first segment ([Note: replicas])
            batch, local = divmod(i, self._m)
            return self._batch_inputs[batch][local], []
        key = self._tensors.activation(i, k - 1)
        if self._stage_of[k - 1] == self.stage:
            return receive(self._handoff.pop(key))
        return self._take(key)

    def hand_on(self, i: int, c: int, k: int, message: Message) -> None:
        """Segment k's output for microbatch i: to the next segment here, or to send."""
        held = self._handoff if self._stage_of[k + 1] == self.stage else self._to_send
        held[self._tensors.activation(i, k)] = message

    def gradient_of(
        self, op: Instruction, k: int, roots: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        """The gradients (from segment k + 1) of `roots`, segment k's output for op's
        microbatch, and the count the message carries (`boundary.read_gradients`).

        Raises:
            RuntimeInstructionError: the gradient does not fit the output.
        """
        key = self._tensors.gradient(op.microbatch, k + 1)
        here = self._stage_of[k + 1] == self.stage
        read = read_gradients(self._handoff.pop(key) if here else self._take(key), roots)
        if isinstance(read, str):
            raise RuntimeInstructionError(
                f"stage {self.stage}: {op} got a gradient from segment {k + 1} that does not fit "
                f"segment {k}'s output: {read}",
                stage=self.stage,
            )
        return read

    def hand_back(self, i: int, c: int, k: int, message: Message) -> None:
        """Segment k's input gradient for microbatch i: to segment k - 1 here, or to send."""
        held = self._handoff if self._stage_of[k - 1] == self.stage else self._to_send
        held[self._tensors.gradient(i, k)] = message

    def _take(self, key: int) -> Any:
        if key not in self._received:
            raise RuntimeInstructionError(
                f"stage {self.stage}: the {self._tensors.describe(key)} has not arrived; the "
                "program must receive it before the compute that needs it",
                stage=self.stage,
            )
        return self._received.pop(key)
