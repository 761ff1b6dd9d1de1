"""Sequence parts' carries for `StageRuntime`: what part j's forward leaves part j + 1 on a segment.

[Note: the parts' calling convention] With `Schedule.num_parts = k > 1` ([Note: sequence parts]
in `schedcc.rules.parts`) a segment is called on one sequence part at a time with the carry of
the part before it as one more argument: `segment(x, carry)` (a tuple value's items, then
`carry`; a dict value's keywords and `carry=carry`), `carry` None for part 0. It returns
`(output, carry)`: the output goes on to the next segment (or the loss) as without parts, the
carry (any boundary value: a tensor, or a tuple of attention's keys and values) to the same
segment's next part. The carry crosses between the two forwards as a boundary value does between
two segments: a `Message`, made fresh leaves for part j + 1, whose gradients are part j + 1's
backward's to hand back to part j's backward, where they join the output's gradients. The last
part's carry is dropped.

    >>> import torch
    >>> def segment(x, carry):
    ...     seen = x if carry is None else torch.cat([carry, x])
    ...     return seen.sum() * x, seen
    >>> carries = Carries(stage=0, num_parts=2)
    >>> value, leaves = carries.take(0, 0)
    >>> x = torch.ones(2, requires_grad=True)
    >>> out, carry = call_part(segment, x, value, where="segment 0")
    >>> roots = carries.hand_on(0, 0, 0, carry)
    >>> value, leaves = carries.take(1, 0)
    >>> value.shape, len(leaves)
    (torch.Size([2]), 1)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from schedcc.backends.runtime.boundary import (
    Message,
    activation,
    gradients,
    read_gradients,
    receive,
)
from schedcc.backends.runtime.values import call
from schedcc.errors import RuntimeInstructionError, ScheduleConfigError

__all__ = ["Carries", "call_part"]


def call_part(segment: Any, value: Any, carry: Any, *, where: str) -> tuple[Any, Any]:
    """`segment` called on one sequence part (the Note's convention): `(output, carry)`.

    Raises:
        ScheduleConfigError: the segment returned anything but a pair.
    """
    if isinstance(value, Mapping):
        result = call(lambda *args, **kwargs: segment(*args, carry=carry, **kwargs), value)
    else:
        result = call(lambda *args: segment(*args, carry), value)
    if type(result) not in (tuple, list) or len(result) != 2:
        raise ScheduleConfigError(
            f"{where} returned {type(result).__name__}, but a schedule with sequence parts calls "
            "each segment as forward(x, carry) and needs (output, carry) back (carry None for "
            "the first part); return the pair"
        )
    return result[0], result[1]


class Carries:
    """The carries and carry gradients of one stage for one run, by (microbatch, chunk).

    Args:
        stage: the stage.
        num_parts: `Schedule.num_parts`; a microbatch index `i` is part `i % num_parts`.
    """

    def __init__(self, stage: int, num_parts: int) -> None:
        self.stage = stage
        self.num_parts = num_parts
        self.reset()

    def reset(self) -> None:
        """A new run: nothing held."""
        self._carries: dict[tuple[int, int], Message] = {}
        self._grads: dict[tuple[int, int], Message] = {}

    def take(self, i: int, c: int) -> tuple[Any, list[torch.Tensor]]:
        """The carry microbatch i's forward of chunk c is called with (None for a first part),
        and its leaves that take a gradient."""
        if i % self.num_parts == 0:
            return None, []
        message = self._carries.pop((i - 1, c), None)
        if message is None:
            raise self._missing(f"F{i}", f"the carry of F{i - 1}, the part before it")
        return receive(message)

    def hand_on(self, i: int, c: int, k: int, carry: Any) -> list[torch.Tensor]:
        """Keep the carry microbatch i's forward of chunk c (segment k) made for the next part;
        the carry's tensors a gradient comes back for (none for a last part, whose carry goes
        nowhere)."""
        if i % self.num_parts == self.num_parts - 1:
            return []
        message, roots = activation(carry, segment=k)
        self._carries[i, c] = message
        return roots

    def hand_back(
        self, i: int, c: int, leaves: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]
    ) -> None:
        """The gradients of the carry leaves microbatch i's forward of chunk c took: for the
        backward of the part before it."""
        if leaves:
            self._grads[i - 1, c] = gradients(leaves, grads)

    def gradient_of(self, op: Any, roots: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients of the carry `roots` of op's forward, from the next part's backward."""
        message = self._grads.pop((op.microbatch, op.chunk), None)
        if message is None:
            raise self._missing(str(op), f"its carry's gradient, from B{op.microbatch + 1}")
        read = read_gradients(message, roots)
        if isinstance(read, str):
            raise RuntimeInstructionError(
                f"stage {self.stage}: {op} got a carry gradient that does not fit its carry: "
                f"{read}",
                stage=self.stage,
            )
        return read[0]

    def _missing(self, op: str, what: str) -> RuntimeInstructionError:
        return RuntimeInstructionError(
            f"stage {self.stage}: {op} needs {what}, which has not run; a sequence part's "
            "forward runs after the part before it and its backward before it",
            stage=self.stage,
        )
