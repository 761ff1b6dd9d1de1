"""insert_sharding: ZeRO-3's `Unshard` and `Reshard` around each chunk's computes of a batch.

Under `zero=3` a chunk's parameters stay sharded across the data-parallel ranks between uses.
Per stage, batch and chunk `c`: `Reshard(c)` right after the chunk's last compute of the batch
(after the `ReduceGrads(c)` that follows it, when that compute adds to the gradients, so the
gradients are reduced into this rank's shard before the parameters go), and `Unshard(c)` before
its first compute of the batch, prefetched: before the compute that precedes it on the stage,
unless that compute comes before the last `OptimizerStep` or the previous `Reshard(c)` (the
gather must fetch the updated weights, and a chunk is released before it is gathered again);
then right after those. A forward-only program gets the same, around its forwards.

    >>> import schedcc
    >>> program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 2), data_parallel=2, zero=3)
    >>> print(program.to_text())
    stage 0: Unshard F0 SA0 F1 SA1 RG1 B1 RG0 Reduce B0 Reduce Reshard Step
    stage 1: Unshard RA0 F0 RA1 F1 B1 SG1 Reduce B0 SG0 Reduce Reshard Step
"""

from __future__ import annotations

from schedcc.ir import (
    SHARDING,
    WEIGHT_GRADIENT,
    Compute,
    Instruction,
    OptimizerStep,
    OverlappedBackward,
    ReduceGrads,
    Reshard,
    Unshard,
)
from schedcc.program import Program

__all__ = ["insert_sharding"]

_SHARDING = frozenset(SHARDING)


def insert_sharding(program: Program) -> Program:
    """The program with ZeRO-3's `Unshard`/`Reshard`; unchanged unless `zero == 3`, or if it
    already holds any."""
    owned = any(not _SHARDING.isdisjoint(map(type, ops)) for ops in program.stages)
    if program.zero != 3 or owned:
        return program
    m = program.schedule.num_microbatches
    return program.evolve(stages=tuple(_insert(ops, m) for ops in program.stages))


def _insert(ops: tuple[Instruction, ...], num_microbatches: int) -> tuple[Instruction, ...]:
    # Each (batch, chunk)'s first and last compute, in program order.
    first: dict[tuple[int, int], int] = {}
    last: dict[tuple[int, int], int] = {}
    computes: list[int] = []
    steps: list[int] = []
    for pos, op in enumerate(ops):
        if isinstance(op, Compute):
            key = (op.microbatch // num_microbatches, op.chunk)
            first.setdefault(key, pos)
            last[key] = pos
            computes.append(pos)
        elif type(op) is OptimizerStep:
            steps.append(pos)
    # `gaps[g]`: what goes between ops[g - 1] and ops[g], releases before gathers.
    gaps: dict[int, list[tuple[int, Instruction]]] = {}
    released_at: dict[int, int] = {}  # chunk -> the gap of its latest Reshard
    for key in sorted(first, key=first.__getitem__):
        _, c = key
        begin = first[key]
        earliest = max(released_at.get(c, 0), max((s + 1 for s in steps if s < begin), default=0))
        before = [pos for pos in computes if pos < begin]
        at = before[-1] if before and before[-1] >= earliest else earliest
        if at < len(ops) and type(ops[at]) is OverlappedBackward:  # keep `F +B` together
            at -= 1
        gaps.setdefault(at, []).append((1, Unshard(c)))
        end = _release_point(ops, last[key])
        gaps.setdefault(end, []).append((0, Reshard(c)))
        released_at[c] = end
    out: list[Instruction] = []
    for pos in range(len(ops) + 1):
        out.extend(op for _, op in sorted(gaps.get(pos, ()), key=lambda item: item[0]))
        if pos < len(ops):
            out.append(ops[pos])
    return tuple(out)


def _release_point(ops: tuple[Instruction, ...], pos: int) -> int:
    """The gap after the last compute at `pos`: past the `ReduceGrads` of its chunk that
    follows a weight-gradient compute, so that the gradients are in the shard first. A tied
    chunk's `ReduceGrads` waits for its `ReduceTied`, which sums whole gradients, so the chunk
    stays whole until then (before the step)."""
    op = ops[pos]
    if isinstance(op, WEIGHT_GRADIENT):
        for later in range(pos + 1, len(ops)):
            if type(ops[later]) is OptimizerStep:
                break
            if type(ops[later]) is ReduceGrads and ops[later].chunk == op.chunk:
                return later + 1
    return pos + 1
