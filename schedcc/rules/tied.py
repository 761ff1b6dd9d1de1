"""Rules on `ReduceTied`: every copy of a tied parameter steps on the sum of all copies' gradients.

[Note: tied rules] For each group `g` of `program.tied`, every stage holding one of its segments
runs one `ReduceTied(g)` per batch: after its last weight gradient of the batch on those chunks
(else a gradient would miss the sum), before the `ReduceGrads` of those chunks (the data-parallel
mean must see the summed gradient, and under ZeRO the reduction moves the gradients into a
shard) and before the `OptimizerStep`. A `ReduceTied` elsewhere meets nothing: a group the
program does not have, a stage that holds none of the group's segments, or an n-th one that
another member lacks. The collective itself is a step of the rendezvous model ([Note: tied
collectives] in `schedcc.semantics.collectives`), so a cycle through it is `check_deadlock`'s.
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.errors import UpdateOrderError
from schedcc.ir import WEIGHT_GRADIENT, OptimizerStep, ReduceGrads, ReduceTied
from schedcc.rules import Context, Problem
from schedcc.semantics.collectives import tie_chunks, tie_members

__all__ = ["check_tied"]


def check_tied(ctx: Context) -> Iterator[Problem]:
    """Each stage of a tied group runs one ReduceTied per batch, after the batch's last weight
    gradient of the group's chunks and before their ReduceGrads and the step; no other stage
    runs one, and the n-th of every member meets the n-th of the others."""
    tied = ctx.program.tied
    members = tie_members(tied, ctx.layout)
    yield from _unmatched(ctx, members)
    for s, ops in enumerate(ctx.stages):
        groups = tie_chunks(tied, ctx.layout, s)
        if groups:
            yield from _on_stage(ctx, s, ops, groups)


def _unmatched(ctx: Context, members) -> Iterator[Problem]:
    tied = ctx.program.tied
    for p in ctx.model.tie_problems:
        where, g = ctx.where(p.stage, p.position), ctx.stages[p.stage][p.position].tie
        if p.kind == "group":
            text = (
                f"{where} sums the copies of tied group {g}, but the program has "
                f"{len(tied)} tied group(s) {list(tied)}; compile with tied=[...] naming the "
                "segments that share parameters, or remove it"
            )
        elif p.kind == "stage":
            text = (
                f"{where}: stage {p.stage} holds none of tied group {g}'s segments "
                f"{tied[g]} (they are on stage(s) {list(members[g])}); remove it"
            )
        else:
            text = (
                f"{where} has no partner on stage {p.peer}, which runs fewer ReduceTied({g}); "
                f"every stage of the group ({list(members[g])}) runs one per batch: add it there "
                "or remove this one"
            )
        yield Problem(UpdateOrderError, text, p.stage, p.position)


def _chunks_of(groups: dict[int, tuple]) -> list[int]:
    """Every chunk of `groups` ({group: chunks})."""
    return [c for chunks in groups.values() for c in chunks]


def _on_stage(ctx: Context, s: int, ops, groups: dict[int, tuple]) -> Iterator[Problem]:
    """The per-batch rules on one stage of tied groups `groups` ({group: chunks})."""
    num_batches, layout = ctx.schedule.num_batches, ctx.layout
    runs = {c: layout.runs_per_batch(layout.segment[s][c]) for c in _chunks_of(groups)}
    group_of = {c: g for g, chunks in groups.items() for c in chunks}
    batch, grads, reduced, done = 0, dict.fromkeys(group_of, 0), {}, set()
    for pos, op in enumerate(ops):
        kind = type(op)
        if isinstance(op, WEIGHT_GRADIENT) and op.chunk in group_of:
            grads[op.chunk] += 1
            if group_of[op.chunk] in done:
                yield _problem(
                    ctx,
                    s,
                    pos,
                    f"adds a gradient of chunk {op.chunk} after this batch's "
                    f"ReduceTied({group_of[op.chunk]}): it would miss the sum of the copies; "
                    "move the ReduceTied after it",
                )
        elif kind is ReduceGrads and op.chunk in group_of and grads[op.chunk]:
            reduced.setdefault(group_of[op.chunk], pos)
        elif kind is ReduceTied and op.tie in groups:
            g = op.tie
            have = sum(grads[c] for c in groups[g])
            if batch >= num_batches:
                yield _problem(
                    ctx,
                    s,
                    pos,
                    "comes after the program's last OptimizerStep: "
                    "there is nothing left to sum; remove it",
                )
            elif g in done:
                yield _problem(
                    ctx, s, pos, f"is a second ReduceTied({g}) in batch {batch}; run one per batch"
                )
            elif have < sum(runs[c] for c in groups[g]):
                yield _problem(
                    ctx,
                    s,
                    pos,
                    f"runs after only {have} of the {sum(runs[c] for c in groups[g])} weight "
                    f"gradients of batch {batch} on chunk(s) {list(groups[g])}; move it after "
                    "the batch's last backward of those chunks",
                )
            elif g in reduced:
                yield _problem(
                    ctx,
                    s,
                    pos,
                    f"comes after {ops[reduced[g]]} (position {reduced[g]}), which "
                    "already reduced the gradients of a tied chunk over data-parallel ranks "
                    "before the copies were summed; put the ReduceTied before it",
                )
            done.add(g)
        elif kind is OptimizerStep:
            for g in sorted(set(groups) - done):
                yield _problem(
                    ctx,
                    s,
                    pos,
                    f"steps batch {batch} before ReduceTied({g}) summed the "
                    f"gradients of the copies of tied group {g} {ctx.program.tied[g]}: the "
                    "copies would drift apart; put a ReduceTied before the step, after the "
                    f"batch's last backward of chunk(s) {list(groups[g])}",
                )
            batch, grads, reduced, done = batch + 1, dict.fromkeys(group_of, 0), {}, set()


def _problem(ctx: Context, s: int, pos: int, text: str) -> Problem:
    return Problem(UpdateOrderError, f"{ctx.where(s, pos)} {text}", s, pos)
