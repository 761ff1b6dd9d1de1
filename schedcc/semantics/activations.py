"""Activation memory: how many microbatch activations a stage holds, counted one way everywhere.

A microbatch's activation on a chunk is held from its `Forward` until its last backward piece:
`Backward`, or `BackwardWeight` when the backward is split (after `BackwardInput` the weight
gradient still needs what the forward saved). A forward whose stage also runs a `Recompute` of
it keeps only its input, so that microbatch is held from its `Recompute` instead ([Note:
recomputation] in docs/design.md). An `Offload` moves a microbatch's activations to the host and
its `Reload` brings them back: between the two they are held on the host, not the device
([Note: offloading] in `schedcc.rules.offload`), and every count here is of the device. The
validator's `max_activations` rule, the simulator's
`peak_activations` and `schedcc.tune` all count with `held_changes`.
"""

from __future__ import annotations

from collections.abc import Sequence

from schedcc.ir import (
    Backward,
    BackwardWeight,
    Forward,
    Instruction,
    Offload,
    OverlappedBackward,
    Recompute,
    Reload,
)

__all__ = [
    "HELD",
    "first_over",
    "held_bytes",
    "held_changes",
    "host_bytes",
    "peak_activations",
    "recomputed",
]

#: How each instruction class changes the activations a stage holds (absent: no change), for a
#: program without `Recompute` (with one, see `held_changes`).
HELD: dict[type, int] = {
    Forward: 1,
    Backward: -1,
    BackwardWeight: -1,
    OverlappedBackward: -1,
    Recompute: 1,
    Offload: -1,
    Reload: 1,
}


def recomputed(ops: Sequence[Instruction]) -> frozenset[tuple[int, int]]:
    """The `(microbatch, chunk)` pairs one stage's program recomputes (its forwards keep only
    their inputs).

    >>> from schedcc.ir import parse
    >>> sorted(recomputed([parse(op) for op in "F0 F1.1 R1.1 B1.1 B0".split()]))
    [(1, 1)]
    """
    return frozenset((op.microbatch, op.chunk) for op in ops if type(op) is Recompute)


def held_changes(ops: Sequence[Instruction]) -> list[int]:
    """Per position of one stage's program, how it changes the activations held (+1, -1, 0).

    >>> from schedcc.ir import parse
    >>> held_changes([parse(op) for op in "F0 F1 R0 B0 B1".split()])
    [0, 1, 1, -1, -1]
    """
    get = HELD.get
    changes = [get(type(op), 0) for op in ops]
    kept_input = recomputed(ops)
    if kept_input:
        for pos, op in enumerate(ops):
            if type(op) is Forward and (op.microbatch, op.chunk) in kept_input:
                changes[pos] = 0
    return changes


def peak_activations(ops: Sequence[Instruction]) -> int:
    """The most microbatch activations one stage's program holds at once.

    >>> from schedcc.ir import parse
    >>> peak_activations([parse(op) for op in "F0 I0 F1 I1 W0 W1".split()])
    2
    >>> peak_activations([parse(op) for op in "F0 F1 R1 B1 R0 B0".split()])
    1
    """
    held = peak = 0
    for change in held_changes(ops):
        held += change
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
    for pos, change in enumerate(held_changes(ops)):
        held += change
        if held > limit:
            return pos, held
    return None


def held_bytes(
    ops: Sequence[Instruction],
    per_chunk: Sequence[float],
    inputs: Sequence[float] | None = None,
    parts: Sequence[Sequence[float]] | None = None,
) -> list[float]:
    """Per position of one stage's program, the activation bytes held after it runs, when one
    microbatch's activations on chunk c take `per_chunk[c]` bytes and its input `inputs[c]`
    (what a forward that is recomputed keeps until its `Recompute`; 0 if not given). With
    sequence parts, `parts[c][j]` (when given) takes the place of `per_chunk[c]` for part j,
    microbatch `i` being part `i % len(parts[c])` ([Note: sequence parts]).

    >>> from schedcc.ir import parse
    >>> held_bytes([parse(op) for op in "F0 F0.1 R0.1 B0.1 B0".split()], [10.0, 100.0], [1, 2])
    [10.0, 12.0, 110.0, 10.0, 0.0]
    """
    kept = recomputed(ops)
    if parts is not None:
        return _held_part_bytes(ops, parts)
    held, out = 0.0, []
    for op in ops:
        kind = type(op)
        if kind is Forward:
            c = op.chunk  # type: ignore[attr-defined]
            if kept and (op.microbatch, c) in kept:  # type: ignore[attr-defined]
                held += inputs[c] if inputs is not None else 0.0
            else:
                held += per_chunk[c]
        elif kind is Recompute:
            c = op.chunk  # type: ignore[attr-defined]
            held += per_chunk[c] - (inputs[c] if inputs is not None else 0.0)
        elif issubclass(kind, (Backward, BackwardWeight)) or kind is Offload:  # `+B`: a Backward
            held -= per_chunk[op.chunk]  # type: ignore[attr-defined]
        elif kind is Reload:
            held += per_chunk[op.chunk]  # type: ignore[attr-defined]
        out.append(held)
    return out


def host_bytes(ops: Sequence[Instruction], per_chunk: Sequence[float]) -> list[float]:
    """Per position of one stage's program, the activation bytes it holds on the host after it
    runs (from each `Offload` to its `Reload`), when one microbatch's activations on chunk c take
    `per_chunk[c]` bytes.

    >>> from schedcc.ir import parse
    >>> host_bytes([parse(op) for op in "F0 O0 F1 L0 B0 B1".split()], [10.0])
    [0.0, 10.0, 10.0, 0.0, 0.0, 0.0]
    """
    held, out = 0.0, []
    for op in ops:
        kind = type(op)
        if kind is Offload:
            held += per_chunk[op.chunk]  # type: ignore[attr-defined]
        elif kind is Reload:
            held -= per_chunk[op.chunk]  # type: ignore[attr-defined]
        out.append(held)
    return out


def _held_part_bytes(ops: Sequence[Instruction], parts: Sequence[Sequence[float]]) -> list[float]:
    """`held_bytes` with a size per sequence part (a program with parts recomputes nothing)."""
    held, out = 0.0, []
    for op in ops:
        kind = type(op)
        if kind is Forward:
            sizes = parts[op.chunk]  # type: ignore[attr-defined]
            held += sizes[op.microbatch % len(sizes)]  # type: ignore[attr-defined]
        elif issubclass(kind, (Backward, BackwardWeight)):  # `+B` is a Backward
            sizes = parts[op.chunk]  # type: ignore[attr-defined]
            held -= sizes[op.microbatch % len(sizes)]  # type: ignore[attr-defined]
        out.append(held)
    return out
