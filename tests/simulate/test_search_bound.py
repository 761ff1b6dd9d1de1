"""`schedcc.search_bound.lower_bound` is a lower bound: no built-in and no found order is faster,
whatever the per-stage costs, comm and memory limit, and it prices what it claims to."""

from __future__ import annotations

import math

import attrs
import pytest
from _builtin_schedules import names
from hypothesis import given
from hypothesis import strategies as st
from strategies import stage_costs

import schedcc
from schedcc import CostModel, MemoryModel, ScheduleError
from schedcc.ir import Copy
from schedcc.registry import build_schedule, get_schedule
from schedcc.search import _compute_orders, _Family, _splits, search
from schedcc.search_bound import lower_bound
from schedcc.tune import _per_chunk

#: The shapes the properties over every built-in draw: p, m, v, full recomputation or not.
BUILTIN_SHAPES = {
    "p": st.integers(1, 4),
    "m": st.integers(1, 6),
    "v": st.sampled_from([1, 2]),
    "recompute": st.booleans(),
    "data": st.data(),
}


def _bound_of(
    program, costs: CostModel, *, limited: bool, recompute: bool, eager: bool = False
) -> float:
    """The bound for the program's own layout and backward form, under its own peak
    activations as the memory limit when `limited`, of the eager timeline with `eager`."""
    schedule = program.schedule
    orders = _compute_orders(program)
    family = _Family.of(schedule, _splits(orders))
    share = family.share
    peaks = schedcc.simulate(program).peak_activations
    limit = [peak / share for peak in peaks] if limited else None
    return lower_bound(
        schedule.num_stages,
        schedule.num_microbatches,
        costs,
        family,
        overlapped=any(text.startswith("+") for row in orders for text in row),
        memory_limit=limit,
        recompute=recompute,
        eager=eager,
    )


@given(**BUILTIN_SHAPES)
def test_no_builtin_beats_the_bound(p, m, v, recompute, data):
    """Every built-in at a random shape, with random per-stage costs and comm, with or without
    full recomputation, takes at least the bound of its layout, without a limit and at its own
    peak activations (an order that offloads activations only without a limit); timed eagerly
    (sends that never wait), at least the eager bound."""
    costs = data.draw(stage_costs(p))
    timed = 0
    for name in names():
        try:
            schedule = build_schedule(get_schedule(name), p, m, num_chunks=v)
            program = schedcc.compile(schedule, recompute=recompute)
        except ScheduleError:
            continue
        share = v // type(schedule).num_replicas
        offloads = any(isinstance(op, Copy) for ops in program.stages for op in ops)
        for eager in (False, True):
            timeline = schedcc.simulate(program, _per_chunk(costs, share), eager=eager)
            for limited in (False, True) if not offloads else (False,):
                bound = _bound_of(
                    program, costs, limited=limited, recompute=recompute, eager=eager
                )
                assert bound <= timeline.makespan + 1e-9, (name, eager, limited, bound)
        timed += 1
    assert timed  # gpipe and 1f1b take every shape


@given(
    p=st.integers(2, 4),
    m=st.integers(2, 6),
    chunks=st.sampled_from([1, 2, (1, 2)]),
    limit=st.none() | st.floats(0.5, 3.0),
    eager=st.booleans(),
    data=st.data(),
)
def test_found_orders_stay_above_the_bound_under_a_limit(p, m, chunks, limit, eager, data):
    """A search with random per-stage costs, comm and memory limit (recomputation allowed),
    timing the rendezvous or the eager timeline, finds an order no faster than its bound, and
    the bound is the least over the searched kinds with the limit applied."""
    costs = data.draw(stage_costs(p))
    try:
        result = search(
            p, m, num_chunks=chunks, costs=costs, memory_limit=limit, recompute=True,
            max_evaluations=20, eager=eager,
        )  # fmt: skip
    except schedcc.ScheduleConfigError:
        return  # nothing fits the limit
    assert result.makespan >= result.bound - 1e-9
    schedule = result.schedule
    split = _splits(schedule.orders)
    own = (
        _Family.of(schedule, split)
        if schedule.places
        else _Family(schedule.num_chunks, schedule.vshape, split)
    )
    paired = any("+" in row for row in schedule.orders)
    assert result.eager is eager
    again = schedcc.simulate(result.program, result.timeline.costs, eager=eager)
    assert again.makespan == pytest.approx(result.makespan)
    assert result.bound <= lower_bound(
        p, m, costs, own, overlapped=paired, memory_limit=limit, eager=eager
    ) + 1e-9


def test_the_memory_limit_prices_recomputation():
    """1F1B's shape at one microbatch per stage: the bound rises above the unlimited one (each
    microbatch held past the limit is recomputed or waited for) and stays below 1F1B with
    full recomputation."""
    family = _Family(1, False, False)
    free = lower_bound(4, 8, CostModel(), family)
    tight = lower_bound(4, 8, CostModel(), family, memory_limit=1.0)
    recomputing = schedcc.simulate(
        schedcc.compile(get_schedule("1f1b")(4, 8), recompute=True)
    ).makespan
    assert free < tight <= recomputing


def test_comm_on_the_round_trip_is_priced():
    """With comm, a middle stage's bound counts the group its round trip forces: the bound
    grows by more than the head and tail hops alone."""
    family = _Family(1, False, False)
    heavy = CostModel(per_stage={1: CostModel(forward=4.0, backward=8.0)})
    with_comm = CostModel(comm=1.0, per_stage={1: CostModel(forward=4.0, backward=8.0, comm=1.0)})
    hops = 1.0 + 1.0  # stage 1's head and tail hop
    assert lower_bound(3, 4, with_comm, family) == lower_bound(3, 4, heavy, family) + hops + 1.0


def test_the_eager_bound_leaves_the_groups_out_and_is_met():
    """Eagerly a message is only in flight: the middle stage's bound keeps the head and tail
    hops but not the group its round trip forces; and at p = 4, m = 8 with comm, the eager
    search's wave at v = 4 meets it where the rendezvous search's stays above its own."""
    family = _Family(1, False, False)
    heavy = CostModel(per_stage={1: CostModel(forward=4.0, backward=8.0)})
    with_comm = CostModel(comm=1.0, per_stage={1: CostModel(forward=4.0, backward=8.0, comm=1.0)})
    hops = 1.0 + 1.0
    assert lower_bound(3, 4, with_comm, family, eager=True) == (
        lower_bound(3, 4, heavy, family) + hops
    )
    costs = CostModel(comm=0.1)
    found = {
        eager: search(4, 8, num_chunks=4, placement="wave", costs=costs, eager=eager,
                      method="heuristic", max_evaluations=60)
        for eager in (False, True)
    }  # fmt: skip
    assert found[True].makespan == pytest.approx(found[True].bound)
    assert found[False].makespan > found[False].bound * 1.05
    # the eager order is the faster one as the engine runs it
    rendezvous_order = found[False]
    eagerly = schedcc.simulate(
        rendezvous_order.program, rendezvous_order.timeline.costs, eager=True
    ).makespan
    assert found[True].makespan < eagerly


@given(**BUILTIN_SHAPES)
def test_no_builtin_beats_the_bound_in_bytes(p, m, v, recompute, data):
    """With random per-stage activation, input, parameter and optimizer bytes, every built-in
    takes at least the bound of its layout under its own peak bytes as the limit (item 4 of the
    Note, weighted by bytes), with or without full recomputation, at ZeRO 0 or 1 over 2 ranks,
    timed eagerly or not."""
    costs = data.draw(stage_costs(p))
    sizes = st.lists(st.integers(1, 64), min_size=p, max_size=p)
    memory = MemoryModel(
        activations=data.draw(sizes), inputs=data.draw(sizes), parameters=data.draw(sizes),
        optimizer=data.draw(sizes),
    )  # fmt: skip
    costs = attrs.evolve(costs, memory=memory)
    dp, zero = data.draw(st.sampled_from([(1, 0), (2, 1)]))
    eager = data.draw(st.booleans())
    timed = 0
    for name in names():
        try:
            schedule = build_schedule(get_schedule(name), p, m, num_chunks=v)
            program = schedcc.compile(schedule, recompute=recompute, data_parallel=dp, zero=zero)
        except ScheduleError:
            continue
        if any(isinstance(op, Copy) for ops in program.stages for op in ops):
            continue  # the memory terms do not hold for an order that offloads
        orders = _compute_orders(program)
        family = _Family.of(schedule, _splits(orders))
        place = family.segments(p)
        timeline = schedcc.simulate(program, _per_chunk(costs, family.share, place), eager=eager)
        bound = lower_bound(
            p, m, costs, family, overlapped=any(t.startswith("+") for row in orders for t in row),
            memory_limit=list(timeline.peak_bytes), recompute=recompute, data_parallel=dp,
            zero=zero, eager=eager,
        )  # fmt: skip
        assert bound <= timeline.makespan + 1e-9, (name, bound, timeline.makespan)
        timed += 1
    assert timed


def test_a_byte_limit_of_equal_sizes_bounds_as_its_microbatch_count():
    """Counted in bytes with every segment's activations `a` and nothing else held, a limit of
    `n * a` bounds as a limit of n whole-stage microbatches (item 4 of the Note); a limit below
    one activation leaves no order."""
    in_bytes = CostModel(memory=MemoryModel(activations=100))
    for family in (_Family(1, False, False), _Family(2, True, True)):
        for n in (1, 2, 3):
            counted = lower_bound(4, 8, CostModel(), family, memory_limit=float(n))
            in_limit = lower_bound(4, 8, in_bytes, family, memory_limit=f"{100 * n}B")
            assert in_limit == pytest.approx(counted, rel=1e-8)
    assert lower_bound(4, 8, in_bytes, _Family(1, False, False), memory_limit=99) == math.inf
