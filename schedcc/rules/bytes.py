"""The rule on bytes: no stage holds more than `validate(..., max_bytes=...)` at any point.

Bytes come from a `schedcc.MemoryModel` (`validate(..., memory=...)`), counted as [Note: bytes
per stage] in `schedcc.semantics.stage_bytes` says: at each point, the activations held there
(from each forward, or its `Recompute`, to its last backward piece), the parameters (ZeRO-3:
whole only from a chunk's `Unshard` to its `Reshard`), 2BW's stashed copies, the gradients
(shards after a ZeRO reduce-scatter) and the optimizer state (sharded under ZeRO).
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.errors import MemoryBoundError
from schedcc.rules import Context, Problem
from schedcc.semantics.stage_bytes import stage_held
from schedcc.sizes import format_size

__all__ = ["check_bytes"]


def check_bytes(ctx: Context) -> Iterator[Problem]:
    """No stage holds more than `ctx.max_bytes` bytes at any point of its program."""
    limit, memory = ctx.max_bytes, ctx.memory
    if limit is None or memory is None:
        return
    program = ctx.program
    versions = program.rule_versions
    for s, ops in enumerate(ctx.stages):
        before, after, _ = stage_held(program, memory, s, ops, versions[s])
        if before > limit:
            yield Problem(
                MemoryBoundError,
                f"stage {s} holds {format_size(before)} of parameters and optimizer state "
                f"before any activation, over the limit of {format_size(limit)}; use ZeRO, "
                "more stages, or a larger limit",
                s,
            )
            continue
        for pos, held in enumerate(after):
            if held > limit:
                yield Problem(
                    MemoryBoundError,
                    f"{ctx.where(s, pos)} makes stage {s} hold {format_size(held)}, over the "
                    f"limit of {format_size(limit)}; recompute (compile(..., recompute=True)), "
                    "use ZeRO, run a backward earlier or lower the in-flight microbatches",
                    s,
                    pos,
                )
                break
