"""Activation memory: how many microbatch activations a stage holds, counted one way everywhere.

A microbatch's activation on a chunk is held from its `Forward` until its last backward piece:
`Backward`, or `BackwardWeight` when the backward is split (after `BackwardInput` the weight
gradient still needs what the forward saved). The validator's `max_activations` rule, the
simulator's `peak_activations` and `schedcc.tune` all count with `HELD`.
"""

from __future__ import annotations

from collections.abc import Sequence

from schedcc.ir import Backward, BackwardWeight, Forward, Instruction, OverlappedBackward

__all__ = ["HELD", "first_over", "peak_activations"]

#: How each instruction class changes the activations a stage holds (absent: no change).
HELD: dict[type, int] = {Forward: 1, Backward: -1, BackwardWeight: -1, OverlappedBackward: -1}


def peak_activations(ops: Sequence[Instruction]) -> int:
    """The most microbatch activations one stage's program holds at once.

    >>> from schedcc.ir import parse
    >>> peak_activations([parse(op) for op in "F0 I0 F1 I1 W0 W1".split()])
    2
    """
    held = peak = 0
    get = HELD.get
    for op in ops:
        held += get(type(op), 0)
        if held > peak:
            peak = held
    return peak


def first_over(ops: Sequence[Instruction], limit: int) -> tuple[int, int] | None:
    """`(position, held)` of the first instruction that makes the stage hold over `limit`.

    >>> from schedcc.ir import parse
    >>> first_over([parse(op) for op in "F0 I0 F1 W0 W1".split()], 1)
    (2, 2)
    """
    held = 0
    get = HELD.get
    for pos, op in enumerate(ops):
        held += get(type(op), 0)
        if held > limit:
            return pos, held
    return None
