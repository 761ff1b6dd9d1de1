"""The rule on bytes: no stage holds more than `validate(..., max_bytes=...)` at any point.

Bytes come from a `schedcc.memory.MemoryModel` (`validate(..., memory=...)`), counted as
[Note: bytes per stage] in `schedcc.memory` says: what the stage holds throughout (parameters,
2BW's stashed copies, gradients and optimizer state, sharded under ZeRO) plus the activations
held at that point (from each forward, or its `Recompute`, to its last backward piece).
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.errors import MemoryBoundError
from schedcc.memory import chunk_sizes, format_size, static_bytes
from schedcc.rules import Context, Problem
from schedcc.semantics import held_bytes, rule_versions

__all__ = ["check_bytes"]


def check_bytes(ctx: Context) -> Iterator[Problem]:
    """No stage holds more than `ctx.max_bytes` bytes at any point of its program."""
    limit, memory = ctx.max_bytes, ctx.memory
    if limit is None or memory is None:
        return
    from schedcc.simulate import peak_live_versions  # the simulator imports the validator

    program = ctx.program
    versions = rule_versions(program)
    for s, ops in enumerate(ctx.stages):
        static = static_bytes(program, memory, s, peak_live_versions(ops, versions[s])).total
        if program.forward_only:
            held = [0.0] * len(ops)
        else:
            sizes = chunk_sizes(program, memory, s, "activations")
            inputs = chunk_sizes(program, memory, s, "inputs")
            held = held_bytes(ops, sizes, inputs)
        if static > limit:
            yield Problem(
                MemoryBoundError,
                f"stage {s} holds {format_size(static)} of parameters, gradients and optimizer "
                f"state before any activation, over the limit of {format_size(limit)}; use "
                "ZeRO, more stages, or a larger limit",
                s,
            )
            continue
        for pos, act in enumerate(held):
            if static + act > limit:
                yield Problem(
                    MemoryBoundError,
                    f"{ctx.where(s, pos)} makes stage {s} hold {format_size(static + act)} "
                    f"({format_size(act)} of activations), over the limit of "
                    f"{format_size(limit)}; recompute (compile(..., recompute=True)), run a "
                    "backward earlier or lower the in-flight microbatches",
                    s,
                    pos,
                )
                break
