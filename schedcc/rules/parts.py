"""The rule on sequence parts: a part's forward after its predecessor's, its backward before.

[Note: sequence parts] Seq1F1B-style schedules split each microbatch of the data along the
sequence into `k = Schedule.num_parts` parts and pipeline the parts. A part is a microbatch index
of its own: with `m = num_microbatches` indices per batch, the batch's data is split into `m / k`
microbatches along the batch dim and each of those into `k` parts along `Schedule.seq_dim`, so
index `i` is part `j = i % k` (`Schedule.part_of`) of data microbatch `i // k`. Everything that
reads one microbatch at a time (tensor identity, comm, weight versions, activation counting, both
simulators, the loss's `1 / m`) reads the parts unchanged.

What parts add is the *carry*: on every segment, part `j + 1`'s forward consumes what part `j`'s
forward left there (attention's keys and values), and so part `j`'s backward needs the gradient
of that carry, which part `j + 1`'s backward makes. A carry never leaves its segment, hence its
stage; so the rule is an order on each stage, per chunk:

- `F(i)` of a part `j > 0` runs after `F(i - 1)` (the carry it consumes exists);
- the input-gradient piece (`B`, `I` or `+B`) of a part `j < k - 1` runs after that of
  `i + 1` (the carry's gradient exists): the parts' backwards run in reverse, part `k - 1`
  first.

The carry is a boundary value like an activation, kept and freed by the same rules: the runtime
holds it from part `j`'s forward until part `j + 1`'s forward takes it as its leaves (then it is
among what that forward saves), and the carry's gradient from part `j + 1`'s backward until part
`j`'s. A forward recomputed from its input (`R`) would need the carry again after it is handed on,
so `compile` refuses recomputation with parts.
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.errors import DependencyError
from schedcc.ir import INPUT_GRADIENT, Backward, BackwardInput, Forward, Recompute
from schedcc.rules import Context, Problem

__all__ = ["check_parts"]


def check_parts(ctx: Context) -> Iterator[Problem]:
    """On each stage and chunk, the parts' forwards run in order and their input-gradient
    pieces in reverse (see [Note: sequence parts])."""
    parts = ctx.schedule.num_parts
    if parts == 1:
        return
    for s, row in enumerate(ctx.computes_and_updates):
        done: set[tuple[type, int, int]] = set()  # (Forward or Backward, microbatch, chunk)
        for pos, op in row:
            if type(op) is Recompute:
                yield Problem(
                    DependencyError,
                    f"{ctx.where(s, pos)} recomputes a sequence part, whose carry is handed on "
                    "to the next part; drop the recomputation (compile without recompute=)",
                    s,
                    pos,
                )
            elif type(op) is Forward or type(op) in INPUT_GRADIENT:
                kind = Forward if type(op) is Forward else Backward  # B, I and +B alike
                i, c, j = op.microbatch, op.chunk, op.microbatch % parts
                if kind is Forward and j > 0 and (Forward, i - 1, c) not in done:
                    yield Problem(DependencyError, _missing(ctx, s, pos, i - 1), s, pos)
                elif kind is not Forward and j < parts - 1 and (kind, i + 1, c) not in done:
                    yield Problem(DependencyError, _missing(ctx, s, pos, i + 1), s, pos)
                done.add((kind, i, c))


def _missing(ctx: Context, s: int, pos: int, other: int) -> str:
    """What op at `pos` lacks from the part `other` (the one before it for a forward, the one
    after it for a backward piece), and the fix."""
    op, parts = ctx.stages[s][pos], ctx.schedule.num_parts
    part, c = op.microbatch % parts, op.chunk
    if type(op) is Forward:
        lacks = (
            f"consumes the carry (attention's keys and values) of part {part - 1}, "
            f"{Forward(other, c)}, which has not run on its segment yet; run "
            f"{Forward(other, c)} before it (the parts' forwards in order)"
        )
    else:
        lacks = (
            f"needs the gradient of its carry, which part {part + 1}'s backward "
            f"({Backward(other, c)} or {BackwardInput(other, c)}) makes and has not run yet; run "
            "the parts' backwards in reverse, the last part first"
        )
    return (
        f"{ctx.where(s, pos)} is part {part} of a microbatch split into {parts} sequence parts "
        f"and {lacks}"
    )
