"""Rules on `GradNorm`: the norm sees a batch's final gradients, once, on every stage alike.

[Note: norm rules] A `GradNorm` measures the gradients the step will apply, so on its stage it
comes after the batch's last weight gradient, `ReduceGrads` and `ReduceTied` and before the
batch's `OptimizerStep`, once per batch. It is a collective of every stage ([Note: the norm
collective] in `schedcc.semantics.norms`): a program has it on every stage or on none, and an
n-th one that another stage lacks meets nothing. A program compiled with `grad_norm=True` (its
`grad_norm` flag) has one before every step: an engine clips or skips steps only through it. A
cycle through it is `check_deadlock`'s.
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.errors import UpdateOrderError
from schedcc.ir import WEIGHT_GRADIENT, GradNorm, OptimizerStep, ReduceGrads, ReduceTied
from schedcc.rules import Context, Problem

__all__ = ["check_norm"]


def check_norm(ctx: Context) -> Iterator[Problem]:
    """Each batch's `GradNorm` on a stage follows its last weight gradient and reductions and
    precedes its step, one per batch; the n-th of every stage meets the n-th of the others."""
    if GradNorm not in ctx.kinds and not ctx.program.grad_norm:
        return
    for p in ctx.model.norm_problems:
        yield Problem(
            UpdateOrderError,
            f"{ctx.where(p.stage, p.position)} has no partner on stage {p.peer}, which runs "
            "fewer GradNorm: every stage runs one per batch, before its step (compile with "
            "grad_norm=True to place them)",
            p.stage,
            p.position,
        )
    for s, ops in enumerate(ctx.stages):
        yield from _on_stage(ctx, s, ops)


def _on_stage(ctx: Context, s: int, ops) -> Iterator[Problem]:
    m = ctx.schedule.num_microbatches
    batch, normed, seen = 0, None, False
    for pos, op in enumerate(ops):
        kind = type(op)
        if kind is GradNorm:
            seen = True
            if batch >= ctx.schedule.num_batches:
                yield _problem(ctx, s, pos, "comes after the program's last step; remove it")
            elif normed is not None:
                yield _problem(ctx, s, pos, f"is a second GradNorm in batch {batch}; run one")
            normed = pos
        elif normed is not None and (
            kind in (ReduceGrads, ReduceTied)
            or (isinstance(op, WEIGHT_GRADIENT) and op.microbatch // m == batch)
        ):
            yield _problem(
                ctx,
                s,
                normed,
                f"measures batch {batch}'s gradients before {op} (position {pos}) changes "
                "them; move the GradNorm right before the step",
            )
            normed = None
        elif kind is OptimizerStep:
            if ctx.program.grad_norm and not seen:
                yield _problem(
                    ctx,
                    s,
                    pos,
                    f"steps batch {batch} without a GradNorm, but the program was compiled "
                    "with grad_norm=True: put one right before the step",
                )
            batch, normed, seen = batch + 1, None, False


def _problem(ctx: Context, s: int, pos: int, text: str) -> Problem:
    return Problem(UpdateOrderError, f"{ctx.where(s, pos)} {text}", s, pos)
