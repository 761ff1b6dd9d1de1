"""Mutation tests for the programs with collectives beyond data parallelism: what the validator
accepts of a mutated program with ties (`ReduceTied`, under ZeRO 0-3), a global gradient norm
(`GradNorm`) or model replicas with overlapped pairs (DualPipe's `+B`) trains exactly.

As in `test_mutation.py`: drop, duplicate, swap or move instructions, move one to another stage,
or insert one of the collectives anywhere; the validator then raises a `ScheduleError` (never
another exception), or the local backend trains the result to the numbers of non-pipelined
training of the same (tied) model, clipped where the program clips.
"""

from __future__ import annotations

import pytest
from _models import make_segments
from _tied_models import WIDTH, adam, batches, mse, tied_segments
from hypothesis import given, settings
from hypothesis import strategies as st
from test_mutation import accepted, mutate, mutations

import schedcc
from schedcc.backends.reference import assert_matches_reference
from schedcc.errors import ScheduleConfigError, UpdateOrderError
from schedcc.ir import GradNorm, ReduceTied

#: Built-ins that take a tie between their first and last segments (zb-v: both on stage 0).
_TIED = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "2bw"]
_TWO_CHUNKS = ("interleaved-1f1b", "zb-v")
#: Mutants are cheap and the point is to try many (ci: 50 per property).
_MANY = settings(max_examples=2 * settings().max_examples)


def _insert(stages, data, collective) -> tuple[tuple, ...]:
    """`stages` with `collective` inserted at a drawn place of a drawn stage (or unchanged)."""
    out = [list(ops) for ops in stages]
    if data.draw(st.booleans(), label="insert a collective"):
        ops = out[data.draw(st.integers(0, len(out) - 1), label="stage")]
        ops.insert(data.draw(st.integers(0, len(ops)), label="at"), collective)
    return tuple(map(tuple, out))


def _train(program, segments, *, clip: bool) -> None:
    size = 2 * program.schedule.num_microbatches * program.data_parallel
    data = batches(2 * program.schedule.num_batches, size)
    assert_matches_reference(
        program, segments, mse, adam, data, max_grad_norm=0.5 if clip else None
    )


@_MANY
@given(
    name=st.sampled_from(_TIED),
    p=st.integers(1, 3),
    m=st.integers(1, 4),
    zero=st.sampled_from([0, 1, 2, 3]),
    grad_norm=st.booleans(),
    edits=mutations(2),
    data=st.data(),
)
def test_a_mutated_tied_program_is_rejected_or_trains_exactly(
    name, p, m, zero, grad_norm, edits, data
):
    """A program tying the first and last segments (dp = 2 under ZeRO, else 1), with or
    without `GradNorm`, mutated and perhaps given a stray `ReduceTied` or `GradNorm`."""
    v = 2 if name in _TWO_CHUNKS else 1
    try:
        schedule = schedcc.get_schedule(name)(p, m, v)
        last = schedule.num_segments - 1
        if last == 0:
            return  # one segment: nothing to tie
        program = schedcc.compile(
            schedule, data_parallel=2 if zero else 1, zero=zero, tied=[(0, last)],
            grad_norm=grad_norm,
        )  # fmt: skip
    except ScheduleConfigError:
        return  # a shape the schedule refuses, or zero=3 with 2BW's weight delay
    stages = mutate(program.stages, edits, v)
    stray = data.draw(st.sampled_from([ReduceTied(0), GradNorm()]), label="collective")
    mutated = program.evolve(stages=_insert(stages, data, stray))
    if accepted(mutated):
        _train(mutated, tied_segments(schedule.num_segments), clip=grad_norm)


@_MANY
@given(
    name=st.sampled_from(["dualpipe", "dualpipe-v"]),
    m=st.sampled_from([4, 6]),
    zero=st.sampled_from([0, 1, 3]),
    grad_norm=st.booleans(),
    edits=mutations(2),
    data=st.data(),
)
def test_a_mutated_dualpipe_is_rejected_or_trains_exactly(name, m, zero, grad_norm, edits, data):
    """The DualPipes at p = 2 (overlapped pairs `F +B`; dualpipe's two replicas tied to each
    other), mutated and perhaps given a stray `ReduceTied` or `GradNorm`."""
    schedule = schedcc.get_schedule(name)(2, m)
    program = schedcc.compile(
        schedule, data_parallel=2 if zero else 1, zero=zero, grad_norm=grad_norm
    )
    stages = mutate(program.stages, edits, schedule.num_chunks)
    stray = data.draw(st.sampled_from([ReduceTied(0), GradNorm()]), label="collective")
    mutated = program.evolve(stages=_insert(stages, data, stray))
    if not accepted(mutated):
        return
    parts = make_segments(schedule.num_segments // type(schedule).num_replicas, width=WIDTH)
    segments = parts + parts if type(schedule).num_replicas == 2 else parts
    _train(mutated, segments, clip=grad_norm)


def test_a_reduce_tied_in_a_program_without_ties_is_refused():
    """A `ReduceTied` meets nothing in a program compiled without `tied`: an
    `UpdateOrderError` naming the missing group, not a crash of the backend."""
    for name in ("1f1b", "dualpipe-v"):
        program = schedcc.compile(schedcc.get_schedule(name)(2, 4))
        stages = ((ReduceTied(0), *program.stages[0]), *program.stages[1:])
        with pytest.raises(UpdateOrderError, match="the program has 0 tied group"):
            schedcc.validate(program.evolve(stages=stages))
