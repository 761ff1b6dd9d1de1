"""`schedcc.search_bound.lower_bound` is a lower bound: no built-in and no found order is faster,
whatever the per-stage costs, comm and memory limit, and it prices what it claims to."""

from __future__ import annotations

import math
import random

import attrs
import pytest
from _builtin_schedules import names
from hypothesis import event, given
from hypothesis import strategies as st
from strategies import stage_costs, warmed_up

import schedcc
from schedcc import CostModel, MemoryModel, ScheduleError
from schedcc.ir import Copy
from schedcc.registry import build_schedule, get_schedule
from schedcc.search import (
    _compute_orders,
    _Family,
    _found_class,
    _ListScheduler,
    _rules,
    _Searcher,
    _splits,
    _whole_backwards,
    placement_name,
    search,
)
from schedcc.search_bound import lower_bound
from schedcc.search_local import kick, move
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


def _one_heavy(stage: int, scale: float, comm: float) -> CostModel:
    """1:2:1 costs (F, B = I + W, I = W = F) with `stage` `scale` times the others."""

    def model(scale: float) -> CostModel:
        return CostModel(forward=scale, backward=2 * scale, backward_input=scale,
                         backward_weight=scale, comm=comm)  # fmt: skip

    return attrs.evolve(model(1.0), per_stage={stage: model(scale)})


@given(**BUILTIN_SHAPES)
def test_no_builtin_beats_the_bound(p, m, v, recompute, data):
    """Every built-in at a random shape, with random per-stage costs and comm, with or without
    full recomputation, a step's first computes warmed up or not, takes at least the bound of
    its layout, without a limit and at its own peak activations (an order that offloads
    activations only without a limit); timed eagerly (sends that never wait), at least the
    eager bound."""
    costs = data.draw(stage_costs(p))
    if data.draw(st.booleans()):
        costs = data.draw(warmed_up(costs))
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
    timing the rendezvous or the eager timeline, a step's first computes warmed up or not, its
    updates (a tied head's all-reduce, the norm, the step) free or not, finds an order no
    faster than its bound, and the bound is the least over the searched kinds with the limit
    applied."""
    costs = data.draw(stage_costs(p))
    if data.draw(st.booleans()):
        costs = data.draw(warmed_up(costs))
    closing = data.draw(st.booleans())
    if closing:
        updates = {"reduce": 0.5, "norm": 0.25, "step": 0.75}
        per_stage = {s: attrs.evolve(c, **updates) for s, c in costs.per_stage.items()}
        costs = attrs.evolve(costs, per_stage=per_stage)
    try:
        result = search(
            p, m, num_chunks=chunks, costs=costs, memory_limit=limit, recompute=True,
            max_evaluations=20, eager=eager, tied=[(0, -1)] if closing else (),
            grad_norm=closing,
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
    # the search bounds the order's layout in pairs where another order of it runs them
    # ([Note: what the bound covers]), which may be above its bound without them: at p = 2,
    # m = 4, DualPipe's layout, 15.5 in pairs against 15.0 for a list-scheduled order of 16.0
    own_bounds = [
        lower_bound(
            p, m, costs, own, overlapped=overlapped, memory_limit=limit, eager=eager,
            grad_norm=closing,
        )
        for overlapped in ((True,) if paired else (False, True))
    ]
    assert result.bound <= max(own_bounds) + 1e-9


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


def test_the_ramps_price_filling_and_emptying_the_limit():
    """p = 4, m = 8, F 1, B 2, at most two whole-stage microbatches held and no recomputation:
    stage 0 holds each microbatch at least 12 (its forward, the round trip 9, its backward),
    two at once, so Little's law gives 48; and the second activation is held only after the
    first forward, the last alone after the second-last backward: 1.5 more (item 4 of the
    Note). CP-SAT proves 51 the optimum of this shape."""
    family = _Family(1, False, False)
    costs = CostModel()
    assert lower_bound(4, 8, costs, family, memory_limit=2.0, recompute=False) == 49.5
    assert lower_bound(4, 8, costs, family, memory_limit=2.0, recompute=False, eager=True) == 49.5
    # one at a time: no ramp, the 96 of 8 microbatches held 12 each, which 1F1B's order meets
    one = schedcc.simulate(schedcc.compile(get_schedule("1f1b")(4, 8)), costs)
    assert lower_bound(4, 8, costs, family, memory_limit=1.0, recompute=False) == 96.0 > 33.0
    assert one.makespan == 33.0  # 1F1B itself holds four on stage 0


def test_a_late_first_backward_under_a_tight_limit_costs_its_wait():
    """p = 4, m = 8, 1:2:1, a 1.3x first stage, at 0.3x 1F1B's activations on the V with
    split backwards: stage 0 holds two chunk activations (0.65 a forward), and its first
    backward, of the last chunk, comes 4.3 after its start; the other 3.0 it idles or runs
    forwards it recomputes later (item 7 of the Note): 34.2 where its work is 31.2. Without
    recomputation Little's law binds instead; at 0.6x, four activations: 1.7 lost."""
    costs = CostModel(per_stage={0: CostModel(forward=1.3, backward=2.6, backward_input=1.3,
                                              backward_weight=1.3)})  # fmt: skip
    family = _Family(2, True, True)
    for eager in (False, True):
        assert lower_bound(4, 8, costs, family, eager=eager) == pytest.approx(31.2)
        assert lower_bound(4, 8, costs, family, memory_limit=1.2, eager=eager) == (
            pytest.approx(34.2)
        )
        assert lower_bound(4, 8, costs, family, memory_limit=2.4, eager=eager) == (
            pytest.approx(32.9)
        )
        assert lower_bound(
            4, 8, costs, family, memory_limit=1.2, recompute=False, eager=eager
        ) > 40.0
    found = search(4, 8, num_chunks=2, placement="v", costs=costs, memory_limit=1.2,
                   recompute=True, max_evaluations=40, eager=True)  # fmt: skip
    assert found.makespan >= 34.2 - 1e-9


def test_a_stage_idles_where_no_input_has_come_before_its_first_backward():
    """Item 7 without a limit: until its first backward a stage runs only forwards, and only
    those whose inputs have come. At p = 8, m = 8, comm 0.1, 1:2:1 with a 1.3x first stage,
    the V's stage 0 holds the first segment and the last, whose inputs come back after a
    microbatch's whole way (9.05): of the 9.7 before its first backward its forwards fill
    5.85, so the bound is 35.05 where the stage's work is 31.2; a searched order meets it."""
    costs = _one_heavy(0, 1.3, comm=0.1)
    family = _Family(2, True, True)
    assert lower_bound(8, 8, costs, family, eager=True) == pytest.approx(35.05)
    found = search(8, 8, num_chunks=2, placement="v", split_backward=True, costs=costs,
                   max_evaluations=20, eager=True)  # fmt: skip
    assert found.bound == pytest.approx(35.05)
    assert found.makespan == pytest.approx(found.bound)


def test_a_forward_dropped_in_the_wait_costs_its_recomputation_not_its_take():
    """Item 7 prices a forward the stage drops while it waits for its first backward at its
    recomputation per unit of the wait it filled, and the forward's take of its input fills
    the wait too (the recomputation has the input at hand): p = 4, m = 4, comm 1, stage 1
    taking 0.5 a message, two activations a stage. An order list scheduling finds runs in
    27.5, where the bound that priced the whole wait at R / F said 28; it says 27."""
    base = CostModel(comm=1.0, overlap=0.0)
    costs = attrs.evolve(base, per_stage={
        1: attrs.evolve(base, backward=3.0, backward_weight=2.0, receive=0.5),
    })  # fmt: skip
    rows = [
        "F0 F1 F2 F3 I0 W0 I1 W1 R2 I2 W2 R3 I3 W3",
        "F0 F1 F2 F3 I0 W0 I1 W1 R2 I2 R3 I3 W2 W3",
        "F0 F1 F2 I0 W0 F3 I1 W1 R2 I2 W2 R3 I3 W3",
        "F0 I0 W0 F1 I1 W1 F2 I2 W2 F3 I3 W3",
    ]
    family = _Family(1, False, True)
    orders = tuple(tuple(row.split()) for row in rows)
    program = schedcc.compile(_found_class(4, 4, family, orders)(4, 4, 1))
    timeline = schedcc.simulate(program, costs, eager=True)
    assert max(timeline.peak_activations) <= 2
    assert timeline.makespan == pytest.approx(27.5)
    bound = lower_bound(4, 4, costs, family, memory_limit=2.0, eager=True)
    assert bound <= timeline.makespan + 1e-9
    # the wait past the two forwards kept: 6; the other two forwards (3 with their takes) run
    # there and are recomputed, repriced at R / (F + take), and the rest is idle: stage 1 has
    # only four forwards to run (26.0 where the bound let forwards fill the whole wait)
    assert bound == pytest.approx(27.0)


def test_what_a_stage_loses_in_stretches_apart_adds_up():
    """Item 10: under a tight limit, what a stage loses before its first backward, after the
    last forward of its lowest segment and after its last input gradient adds up. p = 4,
    m = 4, 1:2:1, a 1.5x last stage, two chunk activations a stage (0.3x 1F1B's), the looped
    F/I/W placement: 21.5 where items 5 and 7 each gave 21.0, and an order CP-SAT found
    meets it; at p = 8, m = 8, comm 1F, 64.5 where they gave 56.5."""

    def costs(p: int, comm: float) -> CostModel:
        return _one_heavy(p - 1, 1.5, comm=comm)

    family = _Family(2, False, True)
    rows = [
        "F0 F1 F2 F3 F0.1 F1.1 F3.1 I0.1 W0.1 R1.1 I1.1 W1.1 R1 I1 F2.1 W1 R3.1 I0 W0 R2.1 "
        "I2.1 W2.1 R2 I2 I3.1 W2 W3.1 R3 I3 W3",
        "F0 F1 F2 F3 F0.1 F1.1 F3.1 I0.1 W0.1 R1.1 I1.1 W1.1 R1 I1 W1 R0 F2.1 I0 W0 R2.1 "
        "I2.1 W2.1 R3.1 I2 I3.1 W2 W3.1 R3 I3 W3",
        "F0 F1 F2 F3 F0.1 F1.1 F3.1 I0.1 W0.1 R1.1 I1.1 W1.1 R0 I1 W1 R3.1 F2.1 I0 W0 R2.1 "
        "I2.1 W2.1 R2 I2 I3.1 W2 W3.1 R3 I3 W3",
        "F0 F1 F3 F0.1 I0.1 W0.1 F1.1 I1.1 W1.1 R1 I1 W1 F2 I0 W0 F2.1 I2.1 W2.1 F3.1 I2 "
        "I3.1 W2 R3 I3 W3 W3.1",
    ]
    orders = tuple(tuple(row.split()) for row in rows)
    program = schedcc.compile(_found_class(4, 4, family, orders)(4, 4, 2))
    timeline = schedcc.simulate(program, _per_chunk(costs(4, 0.0), 2), eager=True)
    assert max(timeline.peak_activations) <= 2
    assert timeline.makespan == pytest.approx(21.5)
    for eager in (False, True):
        bound = lower_bound(4, 4, costs(4, 0.0), family, memory_limit=1.2, eager=eager)
        assert bound == pytest.approx(21.5)
        bound = lower_bound(8, 8, costs(8, 1.0), family, memory_limit=2.4, eager=eager)
        assert bound == pytest.approx(64.5)
        # without recomputation the drops are gone: what the three stretches lose is idle
        assert lower_bound(
            4, 4, costs(4, 0.0), family, memory_limit=1.2, recompute=False, eager=eager
        ) > 21.5


@given(
    p=st.integers(2, 4),
    m=st.integers(2, 8),
    layout=st.sampled_from([(1, False), (2, False), (2, True)]),
    split=st.booleans(),
    in_bytes=st.booleans(),
    eager=st.booleans(),
    data=st.data(),
)
def test_orders_near_the_best_stay_above_the_bound_at_their_own_peak(
    p, m, layout, split, in_bytes, eager, data
):
    """List-scheduled orders under a random limit and orders a few random moves from them
    (recomputations added or dropped), with random per-stage costs and comm, unequal
    microbatches or not, in whole-stage microbatches or in random bytes: each one that
    compiles takes at least the bound of its layout under its own peak as the limit, timed
    eagerly or not. Tight orders like these are where a bound that counts too much fails."""
    costs = data.draw(stage_costs(p))
    if data.draw(st.booleans()):
        costs = attrs.evolve(costs, per_microbatch=[1.0 + (i % 3) / 2 for i in range(m)])
    if in_bytes:
        sizes = st.lists(st.integers(1, 64), min_size=p, max_size=p)
        costs = attrs.evolve(costs, memory=MemoryModel(
            activations=data.draw(sizes), inputs=data.draw(sizes), parameters=data.draw(sizes),
            optimizer=data.draw(sizes),
        ))  # fmt: skip
    v, vshape = layout
    family = _Family(v, vshape, split)
    limit = data.draw(st.floats(0.5, 2.5))
    if in_bytes:  # a few of the largest activations beside what every stage holds throughout
        memory = costs.memory
        limit = limit * max(memory.activations) + 2 * max(memory.parameters) + max(
            memory.optimizer
        )
    searcher = _Searcher(p, m, costs, (limit,) * p, True, False, 1, 0, 0.0, None, None,
                         eager=eager)  # fmt: skip
    scheduler = _ListScheduler(p, m, family, costs, searcher._budgets(family), True, eager=eager)
    rng = random.Random(data.draw(st.integers(0, 1 << 20)))
    orders = [made[1] for made in map(scheduler.run, _rules(family, rng)[:6]) if made]
    orders += [kick(o, rng, rng.randint(1, 8), recompute=True) for o in orders for _ in range(3)]
    orders += [new for o in orders[:6] for new in (move(o, rng) for _ in range(4)) if new]
    timed = 0
    for order in orders:
        try:
            program = schedcc.compile(_found_class(p, m, family, order)(p, m, v))
        except ScheduleError:
            continue
        timeline = searcher._simulate(program, family)
        peak = searcher._held(timeline, family.share)
        bound = lower_bound(p, m, costs, family, memory_limit=list(peak), eager=eager)
        assert bound <= timeline.makespan + 1e-9, (order, bound, timeline.makespan)
        timed += 1
    event(f"timed {'some' if timed else 'none'}")


@given(
    p=st.integers(2, 4),
    m=st.sampled_from([4, 6, 8]),
    name=st.sampled_from(["dualpipe", "dualpipe-v"]),
    recompute=st.booleans(),
    eager=st.booleans(),
    whole=st.booleans(),
    data=st.data(),
)
def test_orders_in_pairs_stay_above_the_bound_at_their_own_peak(
    p, m, name, recompute, eager, whole, data
):
    """DualPipe's orders, with or without full recomputation, with their backwards split or
    each whole (`I`/`W` run as one `B`), and orders a few random moves from them (pairs made
    and parted, recomputations added or dropped), under random per-stage (sometimes
    per-segment) costs, comm and microbatch sizes: each one that compiles takes at least the
    bound of its layout with overlapped pairs under its own peak as the limit (item 9 of the
    Note prices the pairs there), timed eagerly or not. A backward in a pair spans its pair
    on its microbatch's path: of whole backwards, at least what it takes alone where the
    stage's segments cost alike."""
    costs = data.draw(stage_costs(p))
    if data.draw(st.booleans()):
        factors = data.draw(st.lists(st.floats(0.5, 2.0), min_size=m, max_size=m))
        costs = attrs.evolve(costs, per_microbatch=factors)
    try:
        schedule = get_schedule(name)(p, m, 2)
        start = _compute_orders(schedcc.compile(schedule, recompute=recompute))
    except ScheduleError:
        return
    if whole:
        start = _whole_backwards(start)
    family = _Family.of(schedule, not whole)
    rng = random.Random(data.draw(st.integers(0, 1 << 20)))
    orders = [start]
    orders += [kick(start, rng, rng.randint(1, 8), recompute=True, pairs=True) for _ in range(6)]
    orders += [new for new in (move(start, rng, pairs=True) for _ in range(12)) if new]
    searcher = _Searcher(p, m, costs, None, True, False, 1, 0, 0.0, None, None, eager=eager)
    timed = 0
    for order in orders:
        try:
            program = schedcc.compile(_found_class(p, m, family, order)(p, m, 2))
        except ScheduleError:
            continue
        timeline = searcher._simulate(program, family)
        peak = searcher._held(timeline, family.share)
        for limit in (None, list(peak)):
            bound = lower_bound(p, m, costs, family, overlapped=True, memory_limit=limit,
                                eager=eager)  # fmt: skip
            assert bound <= timeline.makespan + 1e-9, (order, limit, bound, timeline.makespan)
        timed += 1
    event(f"timed {'some' if timed else 'none'}")


def test_a_backward_in_a_pair_spans_the_pair_on_its_path():
    """DualPipe's layout at p = 4, m = 8, 1:1.5:0.8, comm 1F, a 1.3x first stage, in pairs
    and whole backwards: each backward on a microbatch's way down takes at least what it takes
    alone, 1.5, where one in a pair was priced at what the pair takes beyond its forward, 1.0
    (its output leaves at the pair's end). So each activation is held longer: at 1F1B's
    activations (four a stage) 27.45, where that gave 25.93 (24.85 to 25.225 without a
    limit); DualPipe's own order, its backwards whole, holds five and takes 32.8."""
    heavy = CostModel(forward=1.3, backward=1.95, backward_input=0.91, backward_weight=1.04,
                      comm=1.0)  # fmt: skip
    costs = CostModel(forward=1.0, backward=1.5, backward_input=0.7, backward_weight=0.8,
                      comm=1.0, per_stage={0: heavy})  # fmt: skip
    schedule = get_schedule("dualpipe")(4, 8, 2)
    family = _Family.of(schedule, False)
    unlimited = lower_bound(4, 8, costs, family, overlapped=True, eager=True)
    assert unlimited == pytest.approx(25.225)
    bound = lower_bound(4, 8, costs, family, overlapped=True, eager=True, memory_limit=4)
    assert bound == pytest.approx(27.45)
    whole = _whole_backwards(_compute_orders(schedcc.compile(schedule)))
    program = schedcc.compile(_found_class(4, 8, family, whole)(4, 8, 2))
    timeline = schedcc.simulate(program, _per_chunk(costs, 1, family.segments(4)), eager=True)
    assert timeline.makespan == pytest.approx(32.8)
    assert timeline.makespan >= unlimited


def _heavy_first_stage_in_pairs(name: str):
    """DualPipe's or DualPipe-V's layout at p = 4, m = 8, 1:2:1, a 1.3x first stage: its
    costs and layout, its bound in pairs at 0.6x 1F1B's activations (the same eagerly or not;
    28.15 without a limit), and the eager timeline of its own order recomputing every
    forward."""
    costs = CostModel(per_stage={0: CostModel(forward=1.3, backward=2.6, backward_input=1.3,
                                              backward_weight=1.3)})  # fmt: skip
    schedule = get_schedule(name)(4, 8, 2)
    family = _Family.of(schedule, True)
    limited = []
    for eager in (False, True):
        unlimited = lower_bound(4, 8, costs, family, overlapped=True, eager=eager)
        assert unlimited == pytest.approx(28.15)
        limited.append(lower_bound(4, 8, costs, family, overlapped=True, memory_limit=2.4,
                                   eager=eager))  # fmt: skip
    assert limited[0] == pytest.approx(limited[1])
    program = schedcc.compile(schedule, recompute=True)
    timeline = schedcc.simulate(program, _per_chunk(costs, family.share), eager=True)
    return costs, family, limited[0], timeline


def test_pairs_under_a_tight_limit_hold_their_activations_longer():
    """Item 9: under a limit a pair's forward is held from the pair's start and its backward's
    until the pair's end, so pairs save work and cost held time. DualPipe at p = 4, m = 8,
    1:2:1, a 1.3x first stage, 0.6x 1F1B's activations (two a stage): 29.28, where pricing
    every held activation as a pair's work gave 28.15, the bound without a limit; its own
    order with recomputation takes more."""
    _, _, limited, timeline = _heavy_first_stage_in_pairs("dualpipe")
    assert limited == pytest.approx(29.2777, abs=1e-4)
    assert max(timeline.peak_activations) <= 2
    assert timeline.makespan >= limited


def test_lone_computes_beside_overlapped_pairs_are_priced():
    """DualPipe's layout at p = 4, m = 8, comm 1F, a 1.5x last stage: priced as pairs, stage 3's
    work is 30; but its first backward can start only 7.5 after its first forward, so five
    forwards (1.5 each) run alone, and each saves nothing (item 8 of the Note): 33.75. Its own
    order, and one local search walked from it, take longer."""
    heavy = CostModel(forward=1.5, backward=3.0, backward_input=1.5, backward_weight=1.5,
                      comm=1.0)  # fmt: skip
    costs = CostModel(comm=1.0, per_stage={3: heavy})
    schedule = get_schedule("dualpipe")(4, 8, 2)
    program = schedcc.compile(schedule, recompute=True)
    orders = _compute_orders(program)
    family = _Family.of(schedule, _splits(orders))
    for eager in (False, True):
        bound = lower_bound(4, 8, costs, family, overlapped=True, eager=eager)
        assert bound == pytest.approx(33.75)
        timeline = schedcc.simulate(program, _per_chunk(costs, 1, family.segments(4)),
                                    eager=eager)  # fmt: skip
        assert timeline.makespan >= bound
    found = search(4, 8, costs=costs, memory_limit=4.0, recompute=True, max_evaluations=60,
                   eager=True)  # fmt: skip
    assert found.makespan >= found.bound - 1e-9


def test_lone_forwards_before_the_first_backward_are_those_the_limit_holds():
    """Item 8 under a limit: DualPipe-V at p = 4, m = 8, 1:2:1, a 1.3x first stage, 0.6x
    1F1B's activations (four chunk activations a stage). Stage 0 waits 4.3 for its first
    backward; its kept forwards fill 2.6 of it, and the rest is idle or forwards recomputed
    at their own cost: 29.0, where forwards filling the whole wait gave 28.15. Its own order
    with recomputation, and the order the search finds, take longer."""
    costs, family, limited, timeline = _heavy_first_stage_in_pairs("dualpipe-v")
    assert limited == pytest.approx(29.0)
    assert max(timeline.peak_activations) <= 2.4 * family.share
    assert timeline.makespan >= limited
    found = search(4, 8, costs=costs, memory_limit=2.4, recompute=True, max_evaluations=40,
                   eager=True)  # fmt: skip
    assert found.bound == pytest.approx(29.0)
    assert found.makespan >= found.bound


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


def test_the_bound_covers_every_layout_the_search_may_return():
    """At p = 4, m = 8, 1:2:1, a 1.5x last stage, 1F1B's activations: 5 evaluations return
    zb-v's 37.5, 30 an order of DualPipe's layout in overlapped pairs, 32.75. The first search's
    bound counts that layout too (its built-ins not timed as though they fit), so it is below
    the second's order; bounding the returned order's layout alone gave 37.5, "optimal"."""
    heavy = CostModel(forward=1.5, backward=3.0, backward_input=1.5, backward_weight=1.5)
    costs = CostModel(per_stage={3: heavy})
    few, more = results = [
        search(4, 8, costs=costs, memory_limit=4, recompute=True, max_evaluations=n, eager=True)
        for n in (5, 30)
    ]
    assert few.makespan == pytest.approx(37.5)
    assert any("+" in row for row in more.schedule.orders)  # DualPipe's pairs
    assert more.makespan == pytest.approx(32.75)
    for result in results:
        assert result.bound <= more.makespan + 1e-9


def test_each_layout_s_bound_is_listed_the_least_first():
    """The same shape, 30 evaluations: `layout_bounds` lists the bound of each layout the
    search may return an order of, the least first and that one `bound`. The placements'
    entries are `lower_bound` of their placement and backward form; the least is of
    DualPipe's two replicas in overlapped pairs, which the order returned runs, and its
    makespan is above its own layout's bound; each layout in pairs is listed without them
    too, so the least without pairs is what no order without them beats (the CLI's line)."""
    heavy = CostModel(forward=1.5, backward=3.0, backward_input=1.5, backward_weight=1.5)
    costs = CostModel(per_stage={3: heavy})
    result = search(4, 8, costs=costs, memory_limit=4, recompute=True, max_evaluations=30,
                    eager=True)  # fmt: skip
    bounds = result.layout_bounds
    assert [b.bound for b in bounds] == sorted(b.bound for b in bounds)
    assert (result.bound, result.bound_from) == (bounds[0].bound, bounds[0].bound_from)
    assert (bounds[0].layout, bounds[0].pairs) == ("two replicas", True)
    placed = [b for b in bounds if b.layout in ("looped", "V")]
    assert {(b.layout, b.num_chunks) for b in placed} >= {("looped", 1), ("looped", 2), ("V", 2)}
    for b in placed:
        family = _Family(b.num_chunks, b.layout == "V", b.split)
        limit = None if b.offloads else 4
        assert b.bound == lower_bound(4, 8, costs, family, overlapped=b.pairs, memory_limit=limit,
                                      recompute=True, eager=True)  # fmt: skip
    found = type(result.schedule)
    split = _splits([row.split() for row in found.orders])
    own = [b for b in bounds if (b.layout, b.num_chunks, b.split, b.pairs)
           == (placement_name(found), found.shape[2], split, True)]  # fmt: skip
    assert own
    assert own[0].bound <= result.makespan + 1e-9
    alone = next(b for b in bounds if not b.pairs)
    assert alone.bound > bounds[0].bound
    kinds = {(b.layout, b.num_chunks, b.split, b.offloads) for b in bounds if not b.pairs}
    assert all((b.layout, b.num_chunks, b.split, b.offloads) in kinds for b in bounds)
    assert str(alone) == (
        f"{alone.layout} v={alone.num_chunks} {'F/I/W' if alone.split else 'F/B'}"
        f"{' offloading' if alone.offloads else ''} {alone.bound:g}"
    )
