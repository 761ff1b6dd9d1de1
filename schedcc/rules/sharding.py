"""The ZeRO-3 rule: every compute runs on a chunk whose parameters are whole.

[Note: sharded chunks] Under `zero=3` each chunk's parameters are released (only this rank's
shard of them is held) at the start of a run, and between a `Reshard(c)` and the next
`Unshard(c)`. A compute on chunk c needs them whole; a `Reshard(c)` may only release a whole
chunk whose weight gradients are already reduced into the shard (else they would be lost), and
an `Unshard(c)` only gathers a released one. A step updates the shards, so no chunk may be whole
across an `OptimizerStep` (its whole copy would be stale), and every chunk is released again by
the end of the program. Every data-parallel replica of a stage runs the stage's one instruction
list (`check_replicas`), so each `Unshard` (an all-gather over the replicas) is met by the same
`Unshard` on every replica.
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.errors import ShardingError
from schedcc.ir import (
    SHARDING,
    WEIGHT_GRADIENT,
    Compute,
    GatherParams,
    OptimizerStep,
    ReduceGrads,
    Reshard,
    Unshard,
)
from schedcc.rules import Context, Problem

__all__ = ["check_sharding"]

_SHARDING = frozenset(SHARDING)


def check_sharding(ctx: Context) -> Iterator[Problem]:
    """Unshard/Reshard only under zero=3; under it, no compute on a released chunk, no gather of
    a whole one, no release of one with unreduced gradients, none whole across a step or at the
    end ([Note: sharded chunks])."""
    if ctx.program.zero != 3:
        if not ctx.kinds.isdisjoint(_SHARDING):
            yield from _outside_zero3(ctx)
        return
    v = ctx.schedule.num_chunks
    for s, ops in enumerate(ctx.computes_and_updates):
        whole, unreduced = [False] * v, [False] * v
        last = -1
        for pos, op in ops:
            last = pos
            kind = type(op)
            if isinstance(op, Compute):
                if not whole[op.chunk]:
                    yield _problem(
                        ctx,
                        s,
                        pos,
                        f"computes on chunk {op.chunk}, whose parameters are "
                        f"released (ZeRO-3 holds only a shard); put Unshard({op.chunk}) before it",
                    )
                    whole[op.chunk] = True  # reported once
                if issubclass(kind, WEIGHT_GRADIENT):  # `+B` is a Backward
                    unreduced[op.chunk] = True
            elif kind is ReduceGrads:
                unreduced[op.chunk] = False
            elif kind is Unshard:
                if whole[op.chunk]:
                    yield _problem(
                        ctx,
                        s,
                        pos,
                        f"gathers chunk {op.chunk}, which is already whole; each "
                        f"Unshard({op.chunk}) needs a Reshard({op.chunk}) before the next",
                    )
                whole[op.chunk] = True
            elif kind is Reshard:
                if not whole[op.chunk]:
                    yield _problem(
                        ctx,
                        s,
                        pos,
                        f"releases chunk {op.chunk}, which is not whole; remove "
                        f"it or put Unshard({op.chunk}) before it",
                    )
                elif unreduced[op.chunk]:
                    yield _problem(
                        ctx,
                        s,
                        pos,
                        f"releases chunk {op.chunk} before its gradients are "
                        f"reduced into the shard; put ReduceGrads({op.chunk}) before it",
                    )
                whole[op.chunk] = False
            elif kind is OptimizerStep and any(whole):
                chunks = [c for c in range(v) if whole[c]]
                yield _problem(
                    ctx,
                    s,
                    pos,
                    f"steps while chunk(s) {chunks} are whole; their whole copies "
                    "would be stale: Reshard them before the step",
                )
            elif kind is GatherParams:
                yield _problem(
                    ctx,
                    s,
                    pos,
                    "is ZeRO-1's gather; under zero=3 the updated shards are "
                    "gathered by the next Unshard: remove it",
                )
        left = [c for c in range(v) if whole[c]]
        if left:
            yield _problem(
                ctx,
                s,
                last,
                f"ends the stage's program with chunk(s) {left} whole; every "
                "Unshard needs its Reshard (after the chunk's last compute)",
            )


def _outside_zero3(ctx: Context) -> Iterator[Problem]:
    for s, ops in enumerate(ctx.computes_and_updates):
        for pos, op in ops:
            if type(op) in _SHARDING:
                yield _problem(
                    ctx,
                    s,
                    pos,
                    f"is ZeRO-3's, but the program has zero={ctx.program.zero}: "
                    "remove it or compile with zero=3",
                )


def _problem(ctx: Context, stage: int, pos: int, what: str) -> Problem:
    return Problem(ShardingError, f"{ctx.where(stage, pos)} {what}", stage, pos)
