"""The rule on overlapped pairs: an `OverlappedBackward` directly follows a forward it can overlap.

[Note: overlapped pairs] DualPipe-style schedules run the forward of one microbatch and the
backward of another at once on one stage, so that each hides the other's communication. schedcc
writes the pair as two instructions, a `Forward` and right after it an `OverlappedBackward`
(`F3.1 +B1`): each keeps its own microbatch and chunk, so everything that reads one compute at a
time (tensor identity, activation counting, weight versions, the runtime) reads the pair as the
forward then the backward, which is what it means. What makes it a pair:

- nothing sits between the two on their stage (the compiler puts the pair's receives before the
  forward and its sends after the backward, `schedcc.passes.insert_comm`);
- the backward needs nothing the forward makes (else they cannot run at once);
- the simulators price the pair as `max(F, B) + overlap * min(F, B)`
  (`schedcc.costs.overlapped_pair`): the forward its own cost, the backward the rest.

The CPU backends run the pair in order, forward then backward, which is exact.
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.errors import OverlapError
from schedcc.ir import Forward, OverlappedBackward
from schedcc.rules import Context, Problem

__all__ = ["check_overlaps"]


def check_overlaps(ctx: Context) -> Iterator[Problem]:
    """Each `OverlappedBackward` directly follows, on its stage, a `Forward` that makes nothing
    it needs."""
    if OverlappedBackward not in ctx.kinds:
        return
    tensors = ctx.tensors
    for s, ops in enumerate(ctx.stages):
        for pos, op in enumerate(ops):
            if type(op) is not OverlappedBackward:
                continue
            before = ops[pos - 1] if pos else None
            if type(before) is not Forward:
                yield Problem(
                    OverlapError,
                    f"{ctx.where(s, pos)} overlaps the forward right before it, but "
                    f"{'nothing' if before is None else before} is there; put the forward to "
                    f"overlap right before it, or make it a plain Backward (B{op.microbatch}"
                    f"{'.' + str(op.chunk) if op.chunk else ''})",
                    s,
                    pos,
                )
                continue
            made = tensors.makes(s, before)
            if made is not None and made in tensors.needs(s, op):
                yield Problem(
                    OverlapError,
                    f"{ctx.where(s, pos)} needs what {before} makes, so they cannot run at once; "
                    "overlap it with another microbatch's forward",
                    s,
                    pos,
                )
