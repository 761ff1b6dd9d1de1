"""Mutated programs: a hypothesis strategy of edits, applying them, and the two outcomes a
mutation property accepts (refused by the validator, or trains exactly on the local backend)."""

from __future__ import annotations

import torch
from _models import batches, make_segments, mse
from hypothesis import strategies as st

from schedcc import GatherParams, OptimizerStep, Program, ReduceGrads, ScheduleError, validate
from schedcc.backends.reference import assert_matches_reference

__all__ = ["KINDS", "accepted", "adam", "mutate", "mutations", "program_data", "trains_exactly"]

KINDS = ("drop", "duplicate", "swap", "move", "cross", "update")


@st.composite
def mutations(draw, max_count: int = 3):
    """A list of (kind, stage, position, other) with the last three as fractions in [0, 1)."""
    unit = st.floats(0, 1, exclude_max=True)
    edit = st.tuples(st.sampled_from(KINDS), unit, unit, unit, unit)
    return draw(st.lists(edit, min_size=1, max_size=max_count))


def mutate(stages, edits, num_chunks: int) -> tuple[tuple, ...]:
    """`stages` with the edits applied (an edit that finds an empty stage does nothing)."""
    out = [list(ops) for ops in stages]
    for kind, at_stage, at, other, where in edits:
        ops = out[int(at_stage * len(out))]
        if kind == "update":
            chunk = int(other * num_chunks)
            op = (ReduceGrads(chunk), OptimizerStep(), GatherParams(chunk))[int(where * 3)]
            ops.insert(int(at * (len(ops) + 1)), op)
            continue
        if not ops:
            continue
        j, k = int(at * len(ops)), int(other * len(ops))
        if kind == "drop":
            del ops[j]
        elif kind == "duplicate":
            ops.insert(k, ops[j])
        elif kind == "swap":
            ops[j], ops[k] = ops[k], ops[j]
        elif kind == "move":
            ops.insert(k, ops.pop(j))
        else:  # cross: to another stage
            target = out[int(where * len(out))]
            target.insert(int(other * (len(target) + 1)), ops.pop(j))
    return tuple(tuple(ops) for ops in out)


def program_data(program: Program, seed: int = 1):
    """Two program runs' worth of float64 batches, evenly split over microbatches and replicas."""
    schedule = program.schedule
    size = 2 * schedule.num_microbatches * program.data_parallel
    return batches(2 * schedule.num_batches, size, seed=seed)


def adam(params):
    return torch.optim.Adam(params, lr=0.05)


def trains_exactly(program: Program) -> None:
    """The local backend trains `program` to the numbers of non-pipelined training (float64)."""
    segments = make_segments(program.schedule.num_segments, seed=3)
    assert_matches_reference(program, segments, mse, adam, program_data(program))


def accepted(program: Program) -> bool:
    """Whether the validator accepts `program`; any error but a `ScheduleError` propagates."""
    try:
        validate(program)
    except ScheduleError:
        return False
    return True
