"""Mutation tests for the programs with collectives beyond data parallelism: what the validator
accepts of a mutated program with ties (`ReduceTied`, under ZeRO 0-3, with recomputation or
not), a global gradient norm (`GradNorm`) or model replicas with overlapped pairs (DualPipe's
`+B`) trains exactly.

As in `test_mutation.py`: drop, duplicate, swap or move instructions, move one to another stage,
or insert one of the collectives anywhere; the validator then raises a `ScheduleError` (never
another exception), or the local backend trains the result to the numbers of non-pipelined
training of the same (tied) model, clipped where the program clips.
"""

from __future__ import annotations

import pytest
from _models import make_segments
from _mutations import accepted, mutate, mutations
from _tied_models import WIDTH, adam, batches, mse, tied_segments
from hypothesis import given, settings
from hypothesis import strategies as st

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
    recompute=st.booleans(),
    edits=mutations(2),
    data=st.data(),
)
def test_a_mutated_tied_program_is_rejected_or_trains_exactly(
    name, p, m, zero, grad_norm, recompute, edits, data
):
    """A program tying the first and last segments (dp = 2 under ZeRO, else 1), with or
    without `GradNorm` and recomputation, mutated and perhaps given a stray `ReduceTied` or
    `GradNorm`."""
    v = 2 if name in _TWO_CHUNKS else 1
    try:
        schedule = schedcc.get_schedule(name)(p, m, v)
        last = schedule.num_segments - 1
        if last == 0:
            return  # one segment: nothing to tie
        program = schedcc.compile(
            schedule, data_parallel=2 if zero else 1, zero=zero, tied=[(0, last)],
            grad_norm=grad_norm, recompute=recompute,
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


# -- a bounded sample on gloo --------------------------------------------------------------------

#: (schedule, m, v, tied, grad_norm) the gloo sample mutates, p = 2.
_GLOO_BASES = [
    ("1f1b", 3, 1, True, True),
    ("interleaved-1f1b", 2, 2, True, False),
    ("dualpipe-v", 4, 2, False, True),
    ("dualpipe", 4, 2, False, False),
]


def _accepted_mutants(count: int, seed: int) -> list:
    """`count` accepted programs that differ from their base, drawn by a seeded generator."""
    import random

    rng = random.Random(seed)
    found = []
    while len(found) < count:
        name, m, v, tied, grad_norm = _GLOO_BASES[len(found) % len(_GLOO_BASES)]
        schedule = schedcc.get_schedule(name)(2, m, v)
        ties = [(0, schedule.num_segments - 1)] if tied else ()
        base = schedcc.compile(schedule, tied=ties, grad_norm=grad_norm)
        kinds = ("drop", "duplicate", "swap", "move", "cross")
        edits = [
            (rng.choice(kinds), *(rng.random() for _ in range(4))) for _ in range(rng.randint(1, 2))
        ]
        stages = [list(ops) for ops in mutate(base.stages, edits, v)]
        if rng.random() < 0.5:
            ops = stages[rng.randrange(2)]
            ops.insert(rng.randrange(len(ops) + 1), rng.choice([ReduceTied(0), GradNorm()]))
        mutated = base.evolve(stages=tuple(map(tuple, stages)))
        if mutated.stages != base.stages and accepted(mutated):
            found.append(mutated)
    return found


def _segments(program):
    schedule = program.schedule
    if type(schedule).num_replicas == 1 and program.tied:
        return tied_segments(schedule.num_segments)
    parts = make_segments(schedule.num_segments // type(schedule).num_replicas, width=WIDTH)
    return parts + parts if type(schedule).num_replicas == 2 else parts


def _gloo_rank(rank: int, world_size: int, count: int, seed: int) -> int:
    import copy
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from schedcc.backends.distributed import Engine
    from schedcc.backends.local import Engine as LocalEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    for number, program in enumerate(_accepted_mutants(count, seed)):
        segments = _segments(program)
        oracle = copy.deepcopy(segments)
        data = batches(2 * program.schedule.num_batches, 2 * program.schedule.num_microbatches)
        clip = 0.5 if program.grad_norm else None
        p2p = ("shm", "nccl")[number % 2]  # nccl: its semantics emulated on gloo
        engine = Engine(program, segments, mse, adam, timeout=60, max_grad_norm=clip, p2p=p2p)
        got = list(engine.train(data))
        want = list(LocalEngine(program, oracle, mse, adam, max_grad_norm=clip).train(data))
        where = f"program {number} (p2p={p2p}):\n{program.to_text()}"
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-12, where
        for c in range(program.schedule.num_chunks):
            k = program.schedule.segment_of(engine.stage, c)
            for a, b in zip(segments[k].parameters(), oracle[k].parameters()):
                assert torch.allclose(a, b, rtol=0, atol=1e-12), where
    dist.destroy_process_group()
    return 0


def test_a_sample_of_accepted_collective_mutants_trains_on_gloo_as_on_the_local_backend():
    """Accepted mutants of tied, clipped and DualPipe programs run on two gloo ranks (shared
    memory, and NCCL's protocol with its semantics emulated, in turn) to the local backend's
    numbers."""
    from schedcc.backends.run.launch import spawn

    assert spawn(_gloo_rank, 2, (4, 20261201), grace=10) == 0


def test_a_clipping_program_without_its_norms_is_refused():
    """A program compiled with grad_norm=True whose every `GradNorm` was dropped (no partner is
    missing: they are all gone) is refused at its first step, not left for an engine to find."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2, num_batches=2), grad_norm=True)
    stages = tuple(tuple(op for op in ops if type(op) is not GradNorm) for ops in program.stages)
    with pytest.raises(UpdateOrderError, match="steps batch 0 without a GradNorm"):
        schedcc.validate(program.evolve(stages=stages))
