"""insert_updates: data-parallel gradient reduction, the optimizer step and ZeRO-1's gather.

Per stage and batch: `ReduceGrads(c)` right after the last weight-gradient compute of chunk c
(and the comm group that follows it, so the pipeline's own send is not delayed), letting the
reduction of early chunks overlap the drain; `OptimizerStep()` once every chunk is reduced; under
ZeRO-1 a `GatherParams(c)` per chunk after the step. `zero=2` reduce-scatters after every
weight-gradient compute instead. Reductions are only inserted where there is something to
reduce: `data_parallel > 1` or ZeRO.
"""

from __future__ import annotations

from schedcc.ir import (
    WEIGHT_GRADIENT,
    Comm,
    GatherParams,
    Instruction,
    OptimizerStep,
    ReduceGrads,
    Update,
)
from schedcc.program import Program

__all__ = ["insert_updates"]


def insert_updates(program: Program) -> Program:
    """The program with its update instructions; unchanged if it already holds any."""
    if any(isinstance(op, Update) for ops in program.stages for op in ops):
        return program
    reduce = program.data_parallel > 1 or program.zero > 0
    schedule = program.schedule
    stages = tuple(
        _insert(ops, schedule.num_microbatches, schedule.num_chunks, reduce, program.zero)
        for ops in program.stages
    )
    return program.evolve(stages=stages)


def _insert(ops, num_microbatches: int, num_chunks: int, reduce: bool, zero: int):
    # After which position does each update go? Keyed by position, in insertion order.
    after: dict[int, list[Instruction]] = {}
    last_grad: dict[tuple[int, int], int] = {}  # (batch, chunk) -> position of last weight-grad
    for pos, op in enumerate(ops):
        if isinstance(op, WEIGHT_GRADIENT):
            batch = op.microbatch // num_microbatches
            last_grad[batch, op.chunk] = pos
            if zero == 2:
                after.setdefault(_past_comm(ops, pos), []).append(ReduceGrads(op.chunk))
    batches = sorted({batch for batch, _ in last_grad})
    for batch in batches:
        ends = {c: last_grad[batch, c] for c in range(num_chunks) if (batch, c) in last_grad}
        if reduce and zero != 2:
            for c, pos in sorted(ends.items(), key=lambda item: item[1]):
                after.setdefault(_past_comm(ops, pos), []).append(ReduceGrads(c))
        step_at = _past_comm(ops, max(ends.values()))
        after.setdefault(step_at, []).append(OptimizerStep())
        if zero >= 1:
            after[step_at].extend(GatherParams(c) for c in sorted(ends))
    out: list[Instruction] = []
    done = 0
    for pos in sorted(after):  # copy the program in slices, the updates between them
        out.extend(ops[done : pos + 1])
        out.extend(after[pos])
        done = pos + 1
    out.extend(ops[done:])
    return tuple(out)


def _past_comm(ops, pos: int) -> int:
    """The last position of the comm group right after `pos` (or `pos` if none follows)."""
    while pos + 1 < len(ops) and isinstance(ops[pos + 1], Comm):
        pos += 1
    return pos
