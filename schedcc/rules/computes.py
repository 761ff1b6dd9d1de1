"""Rules on computes: each runs once, on its own stage, after what it needs; memory bounds."""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.errors import DependencyError, IncompleteScheduleError, MemoryBoundError
from schedcc.ir import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Comm,
    Compute,
    Forward,
    OnMicrobatch,
    OptimizerStep,
    OverlappedBackward,
    RecvActivation,
    RecvGrad,
    SendActivation,
)
from schedcc.rules import Context, Problem
from schedcc.semantics import first_over

__all__ = ["check_complete", "check_dependencies", "check_memory"]

# an overlapped backward is a backward (see [Note: overlapped pairs] in schedcc.rules.overlap)
_COLUMN = {Forward: 0, Backward: 1, BackwardInput: 2, BackwardWeight: 3, OverlappedBackward: 1}


def check_complete(ctx: Context) -> Iterator[Problem]:
    """Each (microbatch, segment) is forwarded once and backwarded once (B, or I then W); each
    stage has one OptimizerStep per batch. A forward-only program has no backward and no step.
    With model replicas, a microbatch runs only the segments of its own ([Note: replicas])."""
    forward_only = ctx.program.forward_only
    # counts[4 * (i * num_segments + k) + n]: how often class n of _COLUMN runs (i, k).
    num_segments = ctx.layout.num_segments
    counts = [0] * (4 * num_segments * ctx.schedule.num_microbatches_total)
    for s, ops in enumerate(ctx.stages):
        seg = ctx.layout.segment[s]
        for op in ops:
            if isinstance(op, Compute) and type(op) in _COLUMN:  # Recompute: rules.recompute
                counts[4 * (op.microbatch * num_segments + seg[op.chunk]) + _COLUMN[type(op)]] += 1
    stage_of, chunk_of = ctx.layout.stage_of, ctx.layout.chunk_of
    quads = zip(counts[0::4], counts[1::4], counts[2::4], counts[3::4])
    layout = ctx.layout
    for index, (f, b, inp, w) in enumerate(quads):
        backward_once = (b, inp, w) in ((1, 0, 0), (0, 1, 1))
        if forward_only:
            backward_once = (b, inp, w) == (0, 0, 0)
        if (
            f == 1
            and backward_once
            and (layout.num_replicas == 1 or layout.runs(*divmod(index, num_segments)))
        ):
            continue
        i, k = divmod(index, num_segments)
        if not layout.runs(i, k):
            if f or b or inp or w:
                yield Problem(
                    IncompleteScheduleError,
                    f"microbatch {i} runs model replica {layout.replica[i % len(layout.replica)]}"
                    f", not segment {k}'s (stage {stage_of[k]}, chunk {chunk_of[k]}); remove "
                    f"its computes there",
                    stage_of[k],
                )
            continue
        s, c = stage_of[k], chunk_of[k]
        what = f"microbatch {i}, segment {k} (stage {s}, chunk {c})"
        if f != 1:
            yield Problem(
                IncompleteScheduleError,
                f"{what} is forwarded {f} times; stage {s} must yield Forward({i}, chunk={c}) "
                "exactly once",
                s,
            )
        if not backward_once and forward_only:
            yield Problem(
                IncompleteScheduleError,
                f"{what} has a backward in a forward-only program; remove it",
                s,
            )
        elif not backward_once:
            yield Problem(
                IncompleteScheduleError,
                f"{what} has {b} Backward, {inp} BackwardInput and {w} BackwardWeight; stage "
                f"{s} must yield either Backward({i}, chunk={c}) once, or "
                f"BackwardInput({i}, chunk={c}) and BackwardWeight({i}, chunk={c}) once each",
                s,
            )
    num_batches = 0 if forward_only else ctx.schedule.num_batches
    for s, ops in enumerate(ctx.stages):
        steps = sum(1 for op in ops if type(op) is OptimizerStep)
        if steps != num_batches:
            yield Problem(
                IncompleteScheduleError,
                f"stage {s} has {steps} OptimizerStep instructions; it needs one per batch "
                f"({num_batches})",
                s,
            )


def check_dependencies(ctx: Context) -> Iterator[Problem]:
    """On its own stage, each compute comes after the tensors it needs (made on this stage or
    received), and each send after the compute that makes what it sends."""
    span = ctx.tensors.span
    # have[key] == s: key was made or received on stage s so far (stages run one after another)
    have = [-1] * (span * ctx.schedule.num_microbatches_total)
    for s, ops in enumerate(ctx.stages):
        table = _needs_and_makes(ctx, s)
        for pos, op in enumerate(ops):
            if not isinstance(op, OnMicrobatch):  # an update
                continue
            entry = table.get((type(op), op.chunk))
            if entry is None:  # a comm op with nothing to move: check_comm reports it
                continue
            needs, makes = entry
            base = op.microbatch * span
            for offset in needs:
                if have[base + offset] != s:
                    text = _needs(ctx, s, op, base + offset)
                    yield Problem(DependencyError, f"{ctx.where(s, pos)} needs {text}", s, pos)
                    break
            if makes >= 0:
                have[base + makes] = s


def _needs_and_makes(ctx: Context, s: int) -> dict[tuple[type, int], tuple[tuple[int, ...], int]]:
    """`(class, chunk) -> (offsets needed before it, offset it makes or -1)` on stage `s`: a
    compute's tensors, a send's tensor (needed), a receive's (made here, as far as the stage
    is concerned)."""
    table = {kind: (use.needs, use.makes) for kind, use in ctx.tensors.compute_table(s).items()}
    for kind, use in ctx.tensors.comm_table(s).items():
        table[kind] = ((use.carries,), -1) if kind[0].is_send else ((), use.carries)
    return table


def _needs(ctx: Context, s: int, op: OnMicrobatch, key: int) -> str:
    """What `op` on stage `s` needed before it: the tensor `key`, as the instruction to add."""
    is_gradient, i, k = ctx.tensors.decode(key)
    c, chunk_of = op.chunk, ctx.layout.chunk_of
    local = ctx.tensors.maker_stage(key) == s
    if isinstance(op, Comm):
        if type(op) is SendActivation:
            return f"the forward that produces it, {Forward(i, c)}, before it"
        return f"the backward that produces it, {Backward(i, c)} or {BackwardInput(i, c)}"
    if type(op) is Forward:
        if local:
            return f"{Forward(i, chunk_of[k])} (the forward of segment {k}) before it"
        return f"its input received first: a RecvActivation {RecvActivation(i, c)} before it"
    if type(op) is BackwardWeight:
        return f"its BackwardInput {BackwardInput(i, c)} before it"
    if not is_gradient:
        return f"its forward {Forward(i, c)} before it"
    if local:
        return f"the backward of segment {k} ({Backward(i, chunk_of[k])})"
    return f"its output gradient received first: {RecvGrad(i, c)} before it"


def check_memory(ctx: Context) -> Iterator[Problem]:
    """No stage holds more than `max_activations` microbatch activations at once (each held
    from its forward to its last backward piece, see `schedcc.semantics.activations`)."""
    limit = ctx.max_activations
    if limit is None or ctx.program.forward_only:  # a forward-only program holds none
        return
    for s, ops in enumerate(ctx.stages):
        over = first_over(ops, limit)
        if over is not None:
            pos, held = over
            yield Problem(
                MemoryBoundError,
                f"{ctx.where(s, pos)} makes stage {s} hold {held} microbatch activations, over "
                f"the limit of {limit} (each is held from its F to its last backward piece, B or "
                "W); run a backward earlier or lower the in-flight microbatches",
                s,
                pos,
            )
