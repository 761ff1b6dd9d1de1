"""Mutation tests: what the validator accepts trains exactly on the real backends.

Edit a valid program — drop, duplicate, swap or move an instruction (comm and updates included),
move one to another stage, or insert an update instruction — under data parallelism and ZeRO.
Then either the validator rejects the result with a `ScheduleError` (never another exception),
or the result is a program every backend runs: the local backend trains it in float64 to the
numbers of non-pipelined training, and a bounded sample runs on gloo (shared memory and gloo
point-to-point) to the local backend's numbers, within a timeout. No model of a backend stands in
for a backend here. `HYPOTHESIS_PROFILE=dev` tries thousands of programs.
"""

from __future__ import annotations

import copy
import random
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _models import make_segments
from _mutations import KINDS, accepted, adam, mutate, mutations, program_data, trains_exactly
from _orders import OrderSchedule, random_orders
from hypothesis import given, settings
from hypothesis import strategies as st

import schedcc
from schedcc import Program, ScheduleError

_SMALL = {"max_stages": 3, "max_microbatches": 4, "max_chunks": 2}
_PARALLEL = st.sampled_from([(1, 0), (2, 0), (2, 1), (2, 2)])
_BUILTINS = st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "2bw"])
#: Mutants are cheap and the point is to try many: four times the profile's examples (ci 100 per
#: property, dev 800).
_MANY = settings(max_examples=4 * settings().max_examples)


@_MANY
@given(random_orders(**_SMALL), _PARALLEL, mutations())
def test_a_mutated_random_program_is_rejected_or_trains_exactly(schedule, parallel, edits):
    """A mutated lowered program raises a ScheduleError, or trains exactly on the local backend."""
    data_parallel, zero = parallel
    program = schedcc.compile(schedule, data_parallel=data_parallel, zero=zero)
    mutated = program.evolve(stages=mutate(program.stages, edits, schedule.num_chunks))
    if accepted(mutated):
        trains_exactly(mutated)


@_MANY
@given(_BUILTINS, st.integers(1, 3), st.integers(1, 4), _PARALLEL, mutations())
def test_a_mutated_builtin_is_rejected_or_trains_exactly(name, p, m, parallel, edits):
    """The same for the built-ins' own programs (2BW's weight delay and ZB-V's V included)."""
    data_parallel, zero = parallel
    cls = schedcc.get_schedule(name)
    try:
        schedule = cls(p, m, 2 if name in ("interleaved-1f1b", "zb-v") else 1)
    except schedcc.ScheduleConfigError:
        return
    program = schedcc.compile(schedule, data_parallel=data_parallel, zero=zero)
    mutated = program.evolve(stages=mutate(program.stages, edits, schedule.num_chunks))
    if accepted(mutated):
        trains_exactly(mutated)


@_MANY
@given(random_orders(**_SMALL), _PARALLEL, mutations())
def test_a_mutated_compute_order_is_rejected_or_trains_exactly(schedule, parallel, edits):
    """A mutated compute order fails to compile with a ScheduleError, or trains exactly."""
    data_parallel, zero = parallel
    orders = mutate(schedule.orders, [e for e in edits if e[0] != "update"], schedule.num_chunks)
    mutated = OrderSchedule(
        schedule.num_stages,
        schedule.num_microbatches,
        schedule.num_chunks,
        schedule.num_batches,
        vshape=schedule.vshape,
        orders=orders,
    )
    try:
        program = schedcc.compile(mutated, data_parallel=data_parallel, zero=zero)
    except ScheduleError:
        return
    trains_exactly(program)


@given(random_orders(**_SMALL), _PARALLEL)
def test_every_compiled_random_order_trains_exactly(schedule, parallel):
    """Unmutated, every dependency-respecting order trains exactly (rejections mean something)."""
    data_parallel, zero = parallel
    trains_exactly(schedcc.compile(schedule, data_parallel=data_parallel, zero=zero))


# -- a bounded sample on gloo --------------------------------------------------------------------

#: (schedule, p, m, v, data_parallel, zero) the gloo sample mutates.
_GLOO_BASES = [
    ("1f1b", 2, 3, 1, 1, 0),
    ("interleaved-1f1b", 2, 2, 2, 1, 0),
    ("zb-h1", 2, 2, 1, 1, 0),
    ("gpipe", 2, 2, 1, 1, 0),
]


def accepted_mutants(count: int, seed: int) -> list[Program]:
    """`count` accepted programs that differ from their base, drawn by a seeded generator."""
    rng = random.Random(seed)
    found: list[Program] = []
    while len(found) < count:
        name, p, m, v, dp, zero = rng.choice(_GLOO_BASES)
        base = schedcc.compile(schedcc.get_schedule(name)(p, m, v), data_parallel=dp, zero=zero)
        edits = [
            (rng.choice(KINDS), rng.random(), rng.random(), rng.random(), rng.random())
            for _ in range(rng.randint(1, 2))
        ]
        mutated = base.evolve(stages=mutate(base.stages, edits, v))
        if mutated.stages != base.stages and accepted(mutated):
            found.append(mutated)
    return found


def _gloo_rank(rank: int, world_size: int, count: int, seed: int) -> None:
    from schedcc.backends.distributed import Engine
    from schedcc.backends.local import Engine as LocalEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    for number, program in enumerate(accepted_mutants(count, seed)):
        for p2p in ("shm", "gloo", "nccl"):  # nccl: its semantics emulated on gloo
            segments = make_segments(program.schedule.num_segments, seed=3)
            oracle = copy.deepcopy(segments)
            data = program_data(program)
            engine = Engine(program, segments, F.mse_loss, adam, timeout=60, p2p=p2p)
            got = list(engine.train(data))
            want = list(LocalEngine(program, oracle, F.mse_loss, adam).train(data))
            where = f"program {number} (p2p={p2p}):\n{program.to_text()}"
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-12, where
            for s, c in ((engine.stage, c) for c in range(program.schedule.num_chunks)):
                k = program.schedule.segment_of(s, c)
                for a, b in zip(segments[k].parameters(), oracle[k].parameters()):
                    assert torch.allclose(a, b, rtol=0, atol=1e-12), where
    dist.destroy_process_group()


def test_a_sample_of_accepted_mutants_trains_on_gloo_as_on_the_local_backend():
    """Accepted mutants of real programs run on gloo (shm, p2p, and NCCL's protocol with its
    blocking semantics) to the local numbers."""
    from schedcc.backends.run.launch import spawn

    assert spawn(_gloo_rank, 2, (6, 20261201), grace=10) == 0
