"""The rule on `Recompute`: it sits between its forward and that microbatch's backward.

[Note: recomputation] (docs/design.md) `R i.c` on a stage declares that the forward `F i.c`
before it kept only its input; `R` rebuilds that forward's graph (on the same RNG state) for the
backward. So it must come after `F i.c`, before the first backward piece of `i` on chunk `c`
(`B`, or `I` when the backward is split: `W` reads what `I` left, which needs the graph), and
once.
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.errors import RecomputeError
from schedcc.ir import Backward, BackwardInput, BackwardWeight, Forward, Recompute
from schedcc.rules import Context, Problem

__all__ = ["check_recompute"]

_BACKWARD = (Backward, BackwardInput, BackwardWeight)


def check_recompute(ctx: Context) -> Iterator[Problem]:
    """Each `Recompute(i, c)` runs after `Forward(i, c)` on its stage, before the first backward
    piece of `i` on chunk `c`, and at most once."""
    if Recompute not in ctx.kinds:
        return
    for s, ops in enumerate(ctx.computes_and_updates):
        if not any(type(op) is Recompute for _, op in ops):
            continue
        forwarded: set[tuple[int, int]] = set()
        backwarded: set[tuple[int, int]] = set()
        rebuilt: set[tuple[int, int]] = set()
        for pos, op in ops:
            kind = type(op)
            if kind is Forward:
                forwarded.add((op.microbatch, op.chunk))
            elif issubclass(kind, _BACKWARD):  # `+B` is a Backward
                backwarded.add((op.microbatch, op.chunk))
            elif kind is Recompute:
                key = (op.microbatch, op.chunk)
                problem = _misplaced(ctx, s, pos, op, key, forwarded, backwarded, rebuilt)
                if problem is not None:
                    yield problem
                rebuilt.add(key)


def _misplaced(ctx, s, pos, op, key, forwarded, backwarded, rebuilt) -> Problem | None:
    i, c = key
    where = ctx.where(s, pos)
    if key in rebuilt:
        text = f"{where} recomputes microbatch {i} on chunk {c} a second time; yield it once"
    elif key not in forwarded:
        text = (
            f"{where} recomputes microbatch {i} on chunk {c} before its forward "
            f"{Forward(i, c)} ran on stage {s}; move it after {Forward(i, c)}"
        )
    elif key in backwarded:
        text = (
            f"{where} recomputes microbatch {i} on chunk {c} after its backward began; move it "
            f"before {Backward(i, c)} (or {BackwardInput(i, c)})"
        )
    else:
        return None
    return Problem(RecomputeError, text, s, pos)
