"""Rules on update instructions and weight versions: what each optimizer step applies, when the
updated weights are back, and which weights every compute runs on.

[Note: update rules] The n-th `OptimizerStep` of a stage applies exactly batch n's weight
gradients: after all of them, before any of batch n + 1, and (with data parallelism or ZeRO)
after each chunk's `ReduceGrads`, which comes once per batch after the chunk's last gradient
(ZeRO-2 reduces after every gradient instead). Under ZeRO a step updates only this rank's shard,
so each chunk's `GatherParams` must follow before that chunk computes again and before the
program ends; without ZeRO there is nothing to gather. Without a weight delay a forward's graph
holds the live weights, so no step or gather may change them before its last backward piece;
with one, the forward ran on a stashed copy (`schedcc.semantics.versions`).
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.errors import UpdateOrderError, WeightVersionError
from schedcc.ir import (
    WEIGHT_GRADIENT,
    Compute,
    Forward,
    GatherParams,
    OptimizerStep,
    ReduceGrads,
)
from schedcc.rules import Context, Problem
from schedcc.semantics import HELD, kept_versions, stashes

__all__ = [
    "check_gathers",
    "check_reductions",
    "check_replicas",
    "check_step_order",
    "check_update_window",
    "check_versions",
]


def check_replicas(ctx: Context) -> Iterator[Problem]:
    """Every data-parallel replica runs the same updates: a `Program` holds one instruction list
    per stage, which each replica of that stage runs, so its collectives (`ReduceGrads`,
    `GatherParams`) meet in the same order on every rank; this checks the program has that shape
    (the other rules read it per stage)."""
    p, found = ctx.schedule.num_stages, len(ctx.stages)
    dp = ctx.program.data_parallel
    if found != p:
        yield Problem(
            UpdateOrderError,
            f"the program has {found} stage program(s) but the schedule has {p} stages; every "
            "data-parallel replica runs one program per stage, so give exactly one per stage",
        )
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        yield Problem(UpdateOrderError, f"data_parallel must be a positive integer, got {dp!r}")


def check_step_order(ctx: Context) -> Iterator[Problem]:
    """The n-th OptimizerStep of a stage comes after every weight gradient of batch n on it and
    before any of batch n + 1."""
    m, layout = ctx.schedule.num_microbatches, ctx.layout
    for s, ops in enumerate(ctx.computes_and_updates):
        expected = sum(map(layout.runs_per_batch, layout.segment[s]))  # weight gradients a batch
        steps, grads = 0, 0  # steps so far; weight gradients of batch `steps` so far
        for pos, op in ops:
            if isinstance(op, WEIGHT_GRADIENT):
                batch = op.microbatch // m
                if batch == steps:
                    grads += 1
                    continue
                when = f"after only {steps}" if batch > steps else f"after {steps}"
                yield Problem(
                    UpdateOrderError,
                    f"{ctx.where(s, pos)} is a weight gradient of batch {batch}, but runs {when} "
                    "optimizer step(s) on this stage; the n-th OptimizerStep must come after "
                    "every weight gradient of batch n and before any of batch n + 1",
                    s,
                    pos,
                )
            elif type(op) is OptimizerStep:
                if grads < expected:
                    yield Problem(
                        UpdateOrderError,
                        f"{ctx.where(s, pos)} is the step of batch {steps}, but only {grads} of "
                        f"its {expected} weight gradients on this stage come before it; move it "
                        "after the batch's last backward",
                        s,
                        pos,
                    )
                steps, grads = steps + 1, 0


def check_reductions(ctx: Context) -> Iterator[Problem]:
    """Each ReduceGrads(c) reduces new gradients of chunk c; with data parallelism or ZeRO every
    chunk's gradients of a batch are reduced, once (ZeRO-2: after each), before its step."""
    program, v = ctx.program, ctx.schedule.num_chunks
    must_reduce = program.data_parallel > 1 or program.zero > 0
    once = must_reduce and program.zero < 2
    for s, ops in enumerate(ctx.computes_and_updates):
        unreduced, reduced = [0] * v, [0] * v
        for pos, op in ops:
            if isinstance(op, WEIGHT_GRADIENT):
                unreduced[op.chunk] += 1
                if once and reduced[op.chunk]:
                    yield Problem(
                        UpdateOrderError,
                        f"{ctx.where(s, pos)} adds a gradient after this batch's ReduceGrads of "
                        f"chunk {op.chunk}; it would never be reduced: move ReduceGrads after it",
                        s,
                        pos,
                    )
            elif type(op) is ReduceGrads:
                if not unreduced[op.chunk]:
                    yield Problem(
                        UpdateOrderError,
                        f"{ctx.where(s, pos)} has no gradient to reduce since the last "
                        "reduction; put it after the chunk's last backward of the batch",
                        s,
                        pos,
                    )
                unreduced[op.chunk] = 0
                reduced[op.chunk] += 1
            elif type(op) is OptimizerStep:
                pending = [c for c in range(v) if unreduced[c]] if must_reduce else []
                if pending:
                    yield Problem(
                        UpdateOrderError,
                        f"{ctx.where(s, pos)} steps before the gradients of chunk(s) {pending} "
                        "are reduced across data-parallel ranks; put ReduceGrads for them before "
                        "it",
                        s,
                        pos,
                    )
                unreduced, reduced = [0] * v, [0] * v


def check_gathers(ctx: Context) -> Iterator[Problem]:
    """GatherParams only under ZeRO; under ZeRO-1 and ZeRO-2, after every OptimizerStep each
    chunk's GatherParams comes before that chunk's next compute and before the program ends
    (ZeRO-3 gathers with `Unshard` instead: `schedcc.rules.sharding`)."""
    zero, v = ctx.program.zero, ctx.schedule.num_chunks
    for s, ops in enumerate(ctx.computes_and_updates):
        stale = [False] * v
        last_step = -1
        for pos, op in ops:
            if type(op) is GatherParams:
                if zero < 1:
                    yield Problem(
                        UpdateOrderError,
                        f"{ctx.where(s, pos)} gathers parameters, but the program has no ZeRO "
                        "(zero=0): every rank holds all its weights, there is nothing to gather; "
                        "remove it or compile with zero=1",
                        s,
                        pos,
                    )
                stale[op.chunk] = False
            elif type(op) is OptimizerStep:
                last_step = pos
                if 1 <= zero <= 2:
                    stale = [True] * v
            elif isinstance(op, Compute) and stale[op.chunk]:
                yield Problem(
                    UpdateOrderError,
                    f"{ctx.where(s, pos)} runs on chunk {op.chunk} after the optimizer step but "
                    f"before its GatherParams({op.chunk}) (ZeRO): its weights are stale; gather "
                    "them first",
                    s,
                    pos,
                )
                stale[op.chunk] = False  # reported once
        missing = [c for c in range(v) if stale[c]]
        if missing:
            yield Problem(
                UpdateOrderError,
                f"{ctx.where(s, last_step)} updates this rank's shard only (ZeRO), but "
                f"GatherParams of chunk(s) {missing} never follows it: the other ranks' updates "
                "never arrive; put a GatherParams per chunk after it",
                s,
                last_step,
            )


def check_versions(ctx: Context) -> Iterator[Problem]:
    """Each compute's weight version exists when it runs, and at most d + 1 are kept."""
    m, delay = ctx.schedule.num_microbatches, ctx.schedule.weight_delay
    for s, (ops, versions) in enumerate(zip(ctx.stages, ctx.program.rule_versions)):
        produced = oldest = 0  # versions made so far on this stage; the oldest one kept
        for pos, version in enumerate(versions):
            if version is None:
                continue
            op = ops[pos]
            if type(op) is OptimizerStep:
                produced, oldest = version, kept_versions(version, delay).start
            elif not oldest <= version <= produced:
                if version > produced:
                    yield Problem(
                        WeightVersionError,
                        f"{ctx.where(s, pos)} needs weight version {version} (batch "
                        f"{op.microbatch // m}, weight_delay {delay}) but only {produced} "
                        "optimizer step(s) have run on this stage; run it after the step that "
                        "produces that version",
                        s,
                        pos,
                    )
                else:
                    yield Problem(
                        WeightVersionError,
                        f"{ctx.where(s, pos)} needs weight version {version}, but after "
                        f"{produced} steps only versions {oldest}..{produced} are kept "
                        f"(weight_delay {delay} keeps {delay + 1}); run it before step "
                        f"{version + delay} or raise weight_delay",
                        s,
                        pos,
                    )


def check_update_window(ctx: Context) -> Iterator[Problem]:
    """Without a weight delay, no OptimizerStep or GatherParams(c) runs between a microbatch's
    forward on a chunk and its last backward piece there (the forward's graph holds the live
    weights, which the update would change under it)."""
    if stashes(ctx.schedule.weight_delay):
        return
    v = ctx.schedule.num_chunks
    for s, ops in enumerate(ctx.computes_and_updates):
        open_: list[dict[int, None]] = [{} for _ in range(v)]  # forwarded, not yet done, in order
        for pos, op in ops:
            if isinstance(op, Compute):
                if type(op) is Forward:
                    open_[op.chunk][op.microbatch] = None
                elif HELD.get(type(op), 0) < 0:
                    open_[op.chunk].pop(op.microbatch, None)
                continue
            if type(op) is GatherParams:
                chunks = [op.chunk]
            elif type(op) is OptimizerStep:
                chunks = list(range(v))
            else:
                continue
            inside = next(((c, i) for c in chunks for i in open_[c]), None)
            if inside is not None:
                c, i = inside
                yield Problem(
                    WeightVersionError,
                    f"{ctx.where(s, pos)} changes the weights of chunk {c} between "
                    f"{Forward(i, c)} and its backward, whose graph still holds them "
                    "(weight_delay 0 stashes none); move it after the backward or before the "
                    "forward",
                    s,
                    pos,
                )
