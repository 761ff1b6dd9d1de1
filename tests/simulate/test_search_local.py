"""Local search's quick clock and moves ([Note: the quick clock] in `schedcc.search_local`)."""

from __future__ import annotations

import copy
import importlib
import itertools
import math
import random
import types

import attrs
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from strategies import stage_costs, warmed_up

from schedcc import CostModel, MemoryModel, ScheduleError, compile, simulate, tune
from schedcc.registry import get_schedule
from schedcc.search import (
    _compute_orders,
    _Family,
    _found_class,
    _ListScheduler,
    _rules,
    _Searcher,
    _splits,
    _variants,
    placement_name,
    search,
)
from schedcc.search_bound import lower_bound
from schedcc.search_local import (
    QuickClock,
    _paired,
    fewer_recomputes,
    kick,
    move,
    moved_everywhere,
    neighbours,
    recomputes,
    same_thread,
)


def _searcher(p, m, costs, limit, v):
    limits = None if limit is None else (limit,) * p
    return _Searcher(p, m, costs, limits, True, False, 1, 0, 0.0, None, None, eager=True)


@given(
    p=st.integers(2, 4),
    m=st.integers(2, 8),
    layout=st.sampled_from([(1, False), (2, False), (2, True)]),
    split=st.booleans(),
    limit=st.none() | st.floats(0.5, 2.5),
    factors=st.booleans(),
    warm=st.booleans(),
    data=st.data(),
)
def test_the_quick_clock_times_orders_as_the_eager_simulator(
    p, m, layout, split, limit, factors, warm, data
):
    """For list-scheduled orders and orders a few random moves from them (some with a
    recomputation added or dropped), under random per-stage costs and comm, unequal
    microbatches, a step's first computes warmed up or not, and a limit or none: where an order
    compiles, the quick clock gives the eager simulator's makespan, and says it is over its
    budget exactly where the simulated order does not fit; where the clock says an order gets
    stuck, the compiler refuses it."""
    costs = data.draw(stage_costs(p, updates=False))  # the clock leaves them out
    if warm:
        costs = data.draw(warmed_up(costs))
    if factors:
        costs = attrs.evolve(costs, per_microbatch=[1.0 + (i % 3) / 2 for i in range(m)])
    v, vshape = layout
    family = _Family(v, vshape, split)
    searcher = _searcher(p, m, costs, limit, v)
    clock = searcher._clock(family)
    budgets = searcher._budgets(family)
    scheduler = _ListScheduler(p, m, family, costs, budgets, True, eager=True)
    rng = random.Random(data.draw(st.integers(0, 1 << 20)))
    orders = [made[1] for made in map(scheduler.run, _rules(family, rng)[:6]) if made]
    orders += [kick(o, rng, rng.randint(1, 8), recompute=True) for o in orders for _ in range(3)]
    orders += [new for o in orders[:6] for new in (move(o, rng) for _ in range(3)) if new]
    compared = _compare(searcher, clock, family, p, m, v, orders)
    event(f"timed {'some' if compared else 'none'}")


@given(
    p=st.integers(2, 4),
    m=st.sampled_from([2, 4, 6, 8]),
    name=st.sampled_from(["dualpipe", "dualpipe-v", "pipedream-2bw", "zb-v", "1f1b"]),
    limit=st.none() | st.floats(0.5, 2.5),
    recompute=st.booleans(),
    warm=st.booleans(),
    data=st.data(),
)
def test_the_quick_clock_times_builtin_layouts_as_the_eager_simulator(
    p, m, name, limit, recompute, warm, data
):
    """The same for the built-ins in their own layouts, as the search starts from them
    (DualPipe's two replicas and overlapped pairs, 2BW's weight delay), with or without full
    recomputation, and a few random moves away, pairs made and parted among them, backwards
    joined to pair them and split where parted (a move that takes a pair's backward from its
    forward is stuck on the clock)."""
    costs = data.draw(stage_costs(p, updates=False))  # the clock leaves them out
    if warm:
        costs = data.draw(warmed_up(costs))
    v = 2 if name in ("dualpipe", "dualpipe-v", "zb-v") else 1
    built = _builtin_on_clock(name, p, m, v, costs, limit, recompute)
    if built is None:
        return  # not at this shape
    orders, family, searcher, clock = built
    rng = random.Random(data.draw(st.integers(0, 1 << 20)))
    candidates = [orders] + [
        kick(orders, rng, rng.randint(1, 6), recompute=True, pairs=k % 2 == 0, split=k < 2)
        for k in range(6)
    ]
    candidates += [
        new for new in (move(orders, rng, pairs=k % 2 == 0, split=k < 4) for k in range(12)) if new
    ]
    compared = _compare(searcher, clock, family, p, m, v, candidates)
    event(f"timed {'some' if compared else 'none'}")


@given(
    p=st.integers(2, 4),
    m=st.sampled_from([2, 4, 6, 8]),
    name=st.sampled_from(["dualpipe", "dualpipe-v"]),
    split=st.booleans(),
    limit=st.none() | st.floats(0.5, 2.5),
    data=st.data(),
)
def test_list_scheduling_in_pairs_keeps_to_its_budget_and_above_the_bound(
    p, m, name, split, limit, data
):
    """List scheduling in DualPipe's layouts (its two replicas, each through its own segments;
    DualPipe-V's V), by rules that run a ready forward and a ready backward as an overlapped
    pair and rules that do not, under random per-stage costs, comm and limits: every order it
    makes compiles (so validates), keeps to its budget, is timed by the quick clock as by the
    eager simulator, and is no faster than the layout's lower bound with overlapped pairs; and
    so does each of the first rules' variants (`_variants`, keeping room for a pair among
    them)."""
    costs = data.draw(stage_costs(p, updates=False))  # the clock leaves them out
    try:
        schedule = get_schedule(name)(p, m, 2)
    except ScheduleError:
        return  # not at this shape
    family = _Family.of(schedule, split)
    searcher = _searcher(p, m, costs, limit, 2)
    scheduler = _ListScheduler(p, m, family, costs, searcher._budgets(family), True, eager=True)
    rng = random.Random(data.draw(st.integers(0, 1 << 20)))
    rules = _rules(family, rng, pairs=True)
    # and the first rules' other ways to hold, recompute and pair
    variants = [variant for rule in rules[:4] for variant in _variants(rule, family, True)]
    made = [made[1] for made in map(scheduler.run, rules[:8] + rules[-4:] + variants) if made]
    bound = lower_bound(p, m, costs, family, overlapped=True, memory_limit=limit,
                        recompute=True, eager=True)  # fmt: skip
    for order in made:
        timeline = searcher._simulate(compile(_found_class(p, m, family, order)(p, m, 2)), family)
        assert searcher._fits(timeline, family.share), order
        assert timeline.makespan >= bound - 1e-9, order
    assert _compare(searcher, searcher._clock(family), family, p, m, 2, made) == len(made)
    paired = any(text.startswith("+") for order in made for row in order for text in row)
    event(f"{'some' if paired else 'no'} pairs, {len(made)} orders")


def test_list_scheduling_in_pairs_meets_dualpipe_s_bound():
    """At p = 4, m = 8, 1:2:1, comm 1F, a 1.5x last stage, no limit: list scheduling in
    DualPipe's layout, pairing a ready forward with a ready backward, makes an order at the
    layout's lower bound with overlapped pairs, 33.75 (the heavy last stage's work as pairs, 30,
    and the five of its computes that run alone, before its first backward can and after its
    last forward), where DualPipe's own order takes 36.5; the search returns it with that
    bound."""
    heavy = CostModel(forward=1.5, backward=3.0, backward_input=1.5, backward_weight=1.5,
                      comm=1.0)  # fmt: skip
    costs = CostModel(comm=1.0, per_stage={3: heavy})
    schedule = get_schedule("dualpipe")(4, 8, 2)
    family = _Family.of(schedule, True)
    searcher = _searcher(4, 8, costs, None, 2)
    scheduler = _ListScheduler(4, 8, family, costs, None, True, eager=True)
    made = [made[1] for made in map(scheduler.run, _rules(family, random.Random(0), pairs=True))]
    clock = searcher._clock(family)
    fastest = min(made, key=clock.time)
    program = compile(_found_class(4, 8, family, fastest)(4, 8, 2))
    assert simulate(program, costs, eager=True).makespan == pytest.approx(33.75)
    assert simulate(compile(schedule), costs, eager=True).makespan == pytest.approx(36.5)
    assert lower_bound(4, 8, costs, family, overlapped=True, eager=True) == pytest.approx(33.75)
    found = search(4, 8, costs=costs, method="heuristic", time_limit=60, eager=True)
    assert (found.makespan, found.bound) == pytest.approx((33.75, 33.75))


@pytest.mark.parametrize("split", [True, False])
def test_list_scheduling_in_dualpipe_s_layout_keeps_room_for_pairs_under_a_limit(split):
    """At p = 4, m = 8, 1:2:1, a 1.3x first stage, four activations a stage (1F1B's): a
    replica's last segment keeps no room for the other replica (its backward follows on the
    stage, freeing it) and the replicas' forwards go in turn, so list scheduling's fastest order
    in DualPipe's layout pairing on every stage takes 31.2 (F/I/W) and 31.4 (F/B) in the
    simulator, and with its rules pairing on the heavy stage only too (`_Rule.busiest_pairs`),
    30.55 (F/I/W); keeping that room, stage 0 recomputed forwards of its loss segment at once,
    the first replica's went first, and the fastest took 33.15 and 33.9."""
    heavy = CostModel(forward=1.3, backward=2.6, backward_input=1.3, backward_weight=1.3)
    costs = CostModel(per_stage={0: heavy})
    family = _Family.of(get_schedule("dualpipe")(4, 8, 2), split)
    searcher = _searcher(4, 8, costs, 4.0, 2)
    budgets = searcher._budgets(family)
    scheduler = _ListScheduler(4, 8, family, costs, budgets, True, eager=True)
    rules = _rules(family, random.Random(0), pairs=True)
    rules += [variant for rule in rules for variant in _variants(rule, family, True)]
    made = [(rule, made[1]) for rule, made in zip(rules, map(scheduler.run, rules)) if made]

    def fastest(orders):
        return _timed(searcher, family, min(orders, key=searcher._clock(family).time))

    everywhere = fastest([orders for rule, orders in made if not rule.busiest_pairs])
    assert everywhere == pytest.approx(31.2 if split else 31.4)
    assert fastest([orders for _, orders in made]) == pytest.approx(30.55 if split else 31.4)


def test_an_overlapped_pair_starts_once_both_inputs_are_there():
    """DualPipe at p = 4, m = 8 with comm 3: its overlapped pairs wait for their backward's
    gradient as well as their forward's activation (53, where a pair that started on its
    forward's alone would make 52), on the clock as in the simulator; an order that splits a
    pair is stuck on the clock."""
    schedule = get_schedule("dualpipe")(4, 8, 2)
    program = compile(schedule)
    orders = _compute_orders(program)
    family = _Family.of(schedule, _splits(orders))
    searcher = _searcher(4, 8, CostModel(comm=3.0), None, 2)
    clock = searcher._clock(family)
    assert clock.time(orders)[0] == searcher._simulate(program, family).makespan == 53.0
    row = orders[0]
    j = row.index("+B5.1")
    split = (row[j], *row[:j], *row[j + 1 :])  # the pair's backward first, on its own
    assert clock.time((split, *orders[1:])) is None


@given(
    p=st.integers(2, 4),
    m=st.sampled_from([2, 4, 6, 8]),
    layout=st.sampled_from([(1, False), (2, False), (2, True)]),
    split=st.booleans(),
    data=st.data(),
)
def test_the_quick_clock_in_bytes_never_passes_an_order_that_does_not_fit(
    p, m, layout, split, data
):
    """With a memory model and a limit in bytes the clock counts every segment's gradients
    from the start (the simulator from its first weight gradient): an order it times fits as
    simulated, at the simulator's makespan (it may call one over its budget that fits)."""
    sizes = st.lists(st.floats(1.0, 50.0), min_size=p, max_size=p)
    memory = MemoryModel(activations=data.draw(sizes), inputs=data.draw(sizes),
                         parameters=data.draw(sizes), optimizer=data.draw(sizes))  # fmt: skip
    costs = attrs.evolve(data.draw(stage_costs(p, updates=False)), memory=memory)
    held = data.draw(st.floats(1.0, 3.0)) * max(memory.activations)  # a few microbatches
    limit = 2 * max(memory.parameters) + max(memory.optimizer) + held
    v, vshape = layout
    family = _Family(v, vshape, split)
    searcher = _Searcher(p, m, costs, (limit,) * p, True, False, 1, 0, 0.0, None, None,
                         eager=True)  # fmt: skip
    clock = searcher._clock(family)
    scheduler = _ListScheduler(p, m, family, costs, searcher._budgets(family), True, eager=True)
    rng = random.Random(data.draw(st.integers(0, 1 << 20)))
    rules = _rules(family, rng)
    orders = [made[1] for made in map(scheduler.run, rules[:4]) if made]
    free = _ListScheduler(p, m, family, costs, None, False, eager=True)  # over the limit too
    orders += [free.run(rule)[1] for rule in rules if rule.cap == math.inf][:2]
    orders += [kick(o, rng, rng.randint(1, 6), recompute=True) for o in orders for _ in range(3)]
    for order in orders:
        quick = clock.time(order)
        if quick is None:
            continue
        try:
            program = compile(_found_class(p, m, family, order)(p, m, v))
        except ScheduleError:
            continue
        timeline = searcher._simulate(program, family)
        assert searcher._fits(timeline, family.share), order
        assert quick[0] == pytest.approx(timeline.makespan, rel=1e-9, abs=1e-9)


def _builtin_on_clock(name, p, m, v, costs, limit, recompute):
    """A built-in's computes in its own layout, with a searcher and its quick clock there:
    `(orders, family, searcher, clock)`, or None where it does not build at this shape."""
    try:
        schedule = get_schedule(name)(p, m, v)
        program = compile(schedule, recompute=recompute)
    except ScheduleError:
        return None
    orders = _compute_orders(program)
    family = _Family.of(schedule, _splits(orders))
    searcher = _searcher(p, m, costs, limit, v)
    return orders, family, searcher, searcher._clock(family)


def _compare(searcher, clock, family, p, m, v, candidates) -> int:
    """Check the clock against the compiler and the eager simulator on `candidates`; how
    many it timed."""
    compared = 0
    for order in candidates:
        assert clock.covers(order)
        quick = clock.time(order)
        try:
            program = compile(_found_class(p, m, family, order)(p, m, v))
        except ScheduleError:
            continue
        if quick is None and _stuck(clock, order):
            pytest.fail(f"the clock says stuck, the compiler accepts: {order}")
        timeline = searcher._simulate(program, family)
        fits = searcher._fits(timeline, family.share)
        assert (quick is not None) == fits, order
        if quick is not None:
            assert quick[0] == pytest.approx(timeline.makespan, rel=1e-9, abs=1e-9)
            compared += 1
    return compared


def _stuck(clock, order) -> bool:
    """Whether `order` gets stuck on the clock (with no limit: not merely over its budget)."""
    free = copy.copy(clock)
    free.budgets = None
    return free.time(order) is None


def test_a_weight_gradient_before_its_input_gradient_is_stuck():
    """An order that runs a weight gradient before its input gradient gets stuck on the clock,
    as the compiler refuses it."""
    family = _Family(1, False, True)
    clock = _searcher(2, 1, CostModel(), None, 1)._clock(family)
    good = (("F0", "I0", "W0"), ("F0", "I0", "W0"))
    bad = (("F0", "W0", "I0"), ("F0", "I0", "W0"))
    # stage 1: F0 at 1-2, I0 2-3, W0 3-4; stage 0: F0 0-1, I0 3-4, W0 4-5
    assert clock.time(good) == (5.0, 5.0 + 4.0)
    assert clock.time(bad) is None
    with pytest.raises(ScheduleError):
        compile(_found_class(2, 1, family, bad)(2, 1, 1))


def test_local_search_on_the_quick_clock_beats_its_start():
    """Under a tight limit on a heavy first stage (p = 4, m = 4, F:B:W 1:1.5:0.8, comm 0.1F,
    0.6x 1F1B's activations), local search on the quick clock improves on the best order
    list scheduling and the built-ins give (16.38, what local search timed by the simulator
    alone ends at): 15.3 in about a second, the same for the same seed and number of
    timings."""
    heavy = CostModel(forward=1.3, backward=1.95, backward_input=0.91, backward_weight=1.04,
                      comm=0.1)  # fmt: skip
    costs = CostModel(backward=1.5, backward_input=0.7, backward_weight=0.8, comm=0.1,
                      per_stage={0: heavy})  # fmt: skip

    def found():
        return search(4, 4, costs=costs, memory_limit=2.4, recompute=True, method="heuristic",
                      max_evaluations=100, time_limit=600, eager=True)  # fmt: skip

    runs = [found(), found()]
    assert runs[0].makespan == runs[1].makespan
    assert runs[0].makespan < 16.0
    assert "local search" in runs[0].source


def test_a_rendezvous_search_walks_on_from_its_climb():
    """A rendezvous search (the default) climbs on the simulator, then walks on the quick
    clock's eager time, the simulator judging: p = 4, m = 4, 1:2:1, comm 1F, a 1.5x last stage,
    0.6x 1F1B's activations: 33.5, where the climb alone stops at 35.0."""
    heavy = CostModel(forward=1.5, backward=3.0, backward_input=1.5, backward_weight=1.5,
                      comm=1.0)  # fmt: skip
    costs = CostModel(comm=1.0, per_stage={3: heavy})
    found = search(4, 4, costs=costs, memory_limit=2.4, recompute=True, method="heuristic",
                   max_evaluations=100, time_limit=600)  # fmt: skip
    assert not found.eager
    assert found.makespan < 35.0 - 1e-9
    assert found.makespan >= found.bound - 1e-9


def test_local_search_adds_no_recomputation_the_search_may_not_make():
    """Without `recompute`, the walk's restarts add no recomputation: at p = 4, m = 8 under one
    microbatch of activations a stage the order found recomputes nothing and keeps to its
    bound, 96 (a walk that added `R`s returned orders that recompute, 75-79, below it)."""
    found = search(4, 8, num_chunks=1, split_backward=False, memory_limit=1, recompute=False,
                   max_evaluations=1000, time_limit=600, eager=True)  # fmt: skip
    assert not any(text.startswith("R") for row in found.schedule.orders for text in row)
    assert found.makespan >= found.bound - 1e-9
    assert found.makespan == 96.0


@given(
    p=st.integers(2, 4),
    m=st.sampled_from([2, 4, 6, 8]),
    layout=st.sampled_from([(1, False), (2, False), (2, True)]),
    split=st.booleans(),
    limit=st.none() | st.floats(0.5, 2.5),
    data=st.data(),
)
def test_list_scheduling_times_only_what_the_quick_clock_ranks_first(
    p, m, layout, split, limit, data
):
    """An eager search compiles and simulates of list scheduling's best few orders the one
    the quick clock times fastest (the next where the simulator does not keep it): nothing is
    lost, the first it keeps is the fastest of all that fit (each compiled and simulated
    here). Simulating them in any other order fails this."""
    costs = data.draw(stage_costs(p))
    v, vshape = layout
    family = _Family(v, vshape, split)
    searcher = _searcher(p, m, costs, limit, v)
    scheduler = _ListScheduler(p, m, family, costs, searcher._budgets(family), True, eager=True)
    rng = random.Random(data.draw(st.integers(0, 1 << 20)))
    chosen = [made[1] for made in map(scheduler.run, _rules(family, rng)[:8]) if made]
    queued = searcher._clocked(family, chosen)
    assert {orders for _, orders in queued} <= set(chosen)
    searcher._time_fastest([(quick, family, orders, "list scheduling") for quick, orders in queued])
    fitting = []
    for order in chosen:
        try:
            program = compile(_found_class(p, m, family, order)(p, m, v))
        except ScheduleError:
            continue
        timeline = searcher._simulate(program, family)
        if searcher._fits(timeline, family.share):
            fitting.append((timeline.makespan, order))
    if fitting:  # the search's deadline is past: it stops at the first it keeps
        assert searcher.best is not None
        assert searcher.best.makespan == pytest.approx(min(m for m, _ in fitting))
    else:
        assert searcher.best is None
    event(f"simulated {searcher.evaluations} of {len(set(chosen))}")


def _first_heavy(comm: float) -> CostModel:
    """The grid's 1:2:1 costs with a 1.3x first stage and `comm` a message."""
    heavy = CostModel(forward=1.3, backward=2.6, backward_input=1.3, backward_weight=1.3,
                      comm=comm)  # fmt: skip
    return CostModel(comm=comm, per_stage={0: heavy})


def _scheduled(family, *_, pairs: bool = False, **__):
    """What `list_schedule` works on: a family, in overlapped pairs or not."""
    return family, ((("+B0",),) if pairs else ())


def _recording(monkeypatch, name: str, calls: list, family_of):
    """Wrap `_Searcher.<name>` to record, at each call, the family it works on, whether its
    orders pair forwards with backwards, and the best makespan then."""
    original = getattr(_Searcher, name)

    def wrapped(self, *args, **kwargs):
        family, orders = family_of(*args, **kwargs)
        paired = any(text.startswith("+") for row in orders for text in row)
        calls.append((family, paired, self.best.makespan))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(_Searcher, name, wrapped)


def test_no_time_goes_to_a_layout_that_cannot_win(monkeypatch):
    """List scheduling and local search build orders of one layout, so none starts on a layout
    whose lower bound is at or above the best makespan found ([Note: hopeless layouts]): at
    p = 4, m = 8, comm 1F, a 1.3x first stage, looped v = 1 F/B is bounded at 42.3 once the
    built-ins reach 41.75, and looped F/I/W's list scheduling meets its own bound, 39.3 (the
    search used to list-schedule the one and walk from the other)."""
    costs = _first_heavy(1.0)
    scheduled, walked = [], []
    _recording(monkeypatch, "list_schedule", scheduled, _scheduled)
    _recording(monkeypatch, "_improve_from", walked, lambda c: (c.family, c.orders))
    found = search(4, 8, costs=costs, memory_limit=4.0, recompute=True, method="heuristic",
                   max_evaluations=1000, time_limit=600, eager=True)  # fmt: skip
    assert walked
    assert scheduled
    for family, paired, best in scheduled + walked:
        bound = lower_bound(4, 8, costs, family, overlapped=paired, memory_limit=4.0,
                            eager=True)  # fmt: skip
        assert bound < best - 1e-9, (family, bound, best)
    assert _Family(1, False, False) not in {family for family, _, _ in scheduled}
    assert _Family(1, False, True) not in {family for family, _, _ in walked}
    assert found.makespan < 39.3 - 1e-9  # faster than the looped placement can be


def test_a_search_whose_order_meets_every_bound_stops(monkeypatch):
    """Where the best order meets the bound of every layout searched, no layout can beat it:
    list scheduling, local search and the exact model are all left out, and the search returns
    at once. At p = 4, m = 4, comm 1F, a 1.3x first stage and no limit, the built-in zb-h2
    meets the least bound, 23.7 (the exact method used to solve every placement for its
    whole time)."""
    pytest.importorskip("ortools")
    costs = _first_heavy(1.0)
    calls = []
    for name, family_of in (
        ("list_schedule", _scheduled),
        ("_improve_from", lambda c: (c.family, c.orders)),
        ("_solve_exact", lambda job, *_: (attrs.evolve(job[0], split=True), ())),
    ):
        _recording(monkeypatch, name, calls, family_of)
    found = search(4, 4, costs=costs, recompute=True, method="exact", time_limit=60,
                   eager=True)  # fmt: skip
    assert calls == []
    assert found.source == "zb-h2"
    assert found.makespan == pytest.approx(23.7)
    assert found.bound == pytest.approx(found.makespan)
    assert found.seconds < 30  # not the minute it was given


@given(
    name=st.sampled_from(["dualpipe", "dualpipe-v"]),
    split=st.booleans(),
    seed=st.integers(0, 1 << 20),
)
def test_a_pair_move_makes_or_parts_one_pair_and_keeps_the_order_of_each_thread(
    name, split, seed
):
    """`_paired` on a stage of DualPipe's order: the same computes (a pair's backward read as
    a backward; where backwards may be split, an input gradient and its weight gradient read
    as one backward), one pair more or one fewer, every pair's backward just after a forward
    run alone, every weight gradient after its input gradient and every input gradient with
    one, and the computes that must keep their order on the stage in it."""
    orders = _compute_orders(compile(get_schedule(name)(4, 8, 2)))
    rng = random.Random(seed)
    row = orders[rng.randrange(4)]
    new = _paired(row, rng, 6, split)
    if new is None:
        return

    def plain(r):
        texts = [text.lstrip("+") for text in r]
        return sorted("B" + t[1:] if t[0] == "I" else t for t in texts if t[0] != "W")

    assert plain(new) == plain(row)
    if not split:
        assert sorted(t.lstrip("+") for t in new) == sorted(t.lstrip("+") for t in row)
    pairs = [sum(text.startswith("+") for text in r) for r in (row, new)]
    assert abs(pairs[1] - pairs[0]) == 1
    for j, text in enumerate(new):
        if text.startswith("+"):
            assert j > 0
            assert text[1] == "B"
            assert new[j - 1].startswith("F")
        if text[0] == "W":
            assert "I" + text[1:] in new[:j]
        if text[0] == "I":  # a backward split whole: its weight gradient follows
            assert "W" + text[1:] in new[j + 1 :]
    where = {text.lstrip("+"): j for j, text in enumerate(new)}
    for a, b in itertools.combinations(row, 2):  # a before b in the row
        a, b = a.lstrip("+"), b.lstrip("+")
        if same_thread(a, b) and a in where and b in where:
            assert where[a] < where[b]
    weights = sum(t[0] == "W" for t in new) - sum(t[0] == "W" for t in row)
    made = "made" if pairs[1] > pairs[0] else "parted"
    event(f"{made}, {['joined', 'whole', 'split'][weights + 1]}" if split else made)


@given(
    name=st.sampled_from(["interleaved-zb", "zb-v", "dualpipe-v"]),
    seed=st.integers(0, 1 << 20),
)
def test_a_move_on_every_stage_moves_one_compute_and_keeps_the_order_of_each_thread(name, seed):
    """`moved_everywhere`: the same computes on every stage, the one moved and no other
    changing places, at most the distance asked on each stage, the computes that must keep
    their order on a stage in it."""
    orders = _compute_orders(compile(get_schedule(name)(4, 8, 2)))
    rng = random.Random(seed)
    row = orders[rng.randrange(4)]
    text, d = rng.choice(row), rng.choice((-1, 1)) * rng.randint(1, 6)
    new = moved_everywhere(orders, text, d)
    if new is None:
        return
    assert new != orders
    for before, after in zip(orders, new, strict=True):
        assert sorted(after) == sorted(before)
        rest = [t for t in before if t != text]
        assert [t for t in after if t != text] == rest
        if text in before:
            assert abs(after.index(text) - before.index(text)) in (0, abs(d))
        where = {t: j for j, t in enumerate(after)}
        for a, b in itertools.combinations(before, 2):  # a before b on the stage
            if same_thread(a, b):
                assert where[a] < where[b]
    event("moved")


def test_a_forward_run_later_on_every_stage_beats_interleaved_zb():
    """p = 8, m = 8, 1:2:1, a 1.3x first stage, no limit: no order one move of one stage
    from interleaved-zb's (33.65) is faster, but its last microbatch's first forward two
    places later on every stage is (33.50, the simulator's time too), and the search, which
    has such moves, returns a faster order than interleaved-zb's."""
    costs = CostModel(per_stage={0: CostModel(forward=1.3, backward=2.6, backward_input=1.3,
                                              backward_weight=1.3)})  # fmt: skip
    family = _Family(2, False, True)
    orders = _compute_orders(compile(get_schedule("interleaved-zb")(8, 8, 2)))
    searcher = _searcher(8, 8, costs, None, 2)
    clock = searcher._clock(family)
    before = clock.time(orders)[0]
    assert before == pytest.approx(33.65)
    idle = [0.0] * 8
    one_stage = [new for new in neighbours(orders, idle) if sum(
        a != b for a, b in zip(new, orders)) == 1]  # fmt: skip
    assert one_stage
    timed = [clock.time(new) for new in one_stage]
    assert all(t is None or t[0] >= before - 1e-9 for t in timed)
    later = moved_everywhere(orders, "F7", 2)
    assert clock.time(later)[0] == pytest.approx(33.5)
    program = compile(_found_class(8, 8, family, later)(8, 8, 2))
    assert searcher._simulate(program, family).makespan == pytest.approx(33.5)
    found = search(8, 8, costs=costs, num_chunks=2, placement="looped", split_backward=True,
                   method="heuristic", max_evaluations=40, time_limit=600, eager=True)  # fmt: skip
    assert found.makespan < before - 1e-9


def test_the_quick_clock_adds_each_stage_s_optimizer_step():
    """The quick clock adds each stage's step after its last compute, as the simulator runs
    it: a step of 5 on stage 1 of 1F1B at p = 3 decides the makespan (stage 0 ends last
    without it). Without it, an eager search could compile the order the clock ranks first
    and miss a faster one (`test_list_scheduling_times_only_what_the_quick_clock_ranks_first`
    found it)."""
    costs = CostModel(per_stage={1: CostModel(step=5.0)})
    schedule = get_schedule("1f1b")(3, 4)
    program = compile(schedule)
    orders = _compute_orders(program)
    family = _Family.of(schedule, _splits(orders))
    clock = _searcher(3, 4, costs, None, 1)._clock(family)
    without = simulate(program, CostModel(), eager=True).makespan
    timeline = simulate(program, costs, eager=True)
    assert timeline.makespan > without + 1  # the step on stage 1 ends the run
    assert clock.time(orders)[0] == pytest.approx(timeline.makespan)


@given(
    p=st.integers(2, 4),
    m=st.sampled_from([2, 4, 6, 8]),
    name=st.sampled_from(["dualpipe", "dualpipe-v", "zb-v", "interleaved-1f1b", "1f1b"]),
    limit=st.floats(0.5, 2.5),
    data=st.data(),
)
def test_fewer_recomputes_keeps_those_the_limit_needs(p, m, name, limit, data):
    """From a built-in recomputing every forward, under random per-stage costs and comm and a
    limit it fits: `fewer_recomputes` drops recomputations only, and the order it returns
    compiles, fits the limit and runs no slower, the eager simulator timing it as the quick
    clock does; each recomputation it keeps is over the limit or slower dropped alone. Out of
    time it stops before trying one alone."""
    costs = data.draw(stage_costs(p, updates=False))  # the clock leaves them out
    v = 1 if name == "1f1b" else 2
    built = _builtin_on_clock(name, p, m, v, costs, limit, recompute=True)
    if built is None:
        return  # not at this shape
    orders, family, searcher, clock = built
    start = clock.time(orders)
    if start is None:
        return  # over the limit even so
    fewer = fewer_recomputes(orders, clock)
    for row, kept in zip(orders, fewer, strict=True):
        assert [t for t in row if not recomputes(t)] == [t for t in kept if not recomputes(t)]
        redone = iter([t for t in row if recomputes(t)])
        assert all(t in redone for t in kept if recomputes(t))  # some of them, in order
    end = clock.time(fewer)
    assert end is not None
    assert end[0] <= start[0] + 1e-9
    for s, row in enumerate(fewer):
        for j in (j for j, text in enumerate(row) if recomputes(text)):
            alone = clock.time((*fewer[:s], row[:j] + row[j + 1 :], *fewer[s + 1 :]))
            assert alone is None or alone[0] > end[0] + 1e-9
    assert _compare(searcher, clock, family, p, m, v, [fewer]) == 1
    event(f"dropped {'some' if fewer != orders else 'none'}")
    # out of time once a pass begins: none dropped one at a time, only a stage's all at once
    asked = iter([False])
    hurried = fewer_recomputes(orders, clock, stop=lambda: next(asked, True))
    assert all(new == row or not any(map(recomputes, new)) for row, new in zip(orders, hurried))


def test_local_search_stops_at_the_first_move_past_its_time(monkeypatch):
    """Every order the quick clock times counts against the time limit: where each timing
    takes a fortieth of the limit (on a stand-in clock), the search ends within a timing or
    two of it (checked only every 32 moves, it ended 0.8 s late)."""
    now = [0.0]

    def monotonic() -> float:
        now[0] += 1e-4  # everything else takes a little time too
        return now[0]

    timed = QuickClock.time

    def slow(self, orders):
        now[0] += 0.05
        return timed(self, orders)

    search_module = importlib.import_module("schedcc.search")  # not the function
    monkeypatch.setattr(search_module, "time", types.SimpleNamespace(monotonic=monotonic))
    monkeypatch.setattr(QuickClock, "time", slow)
    found = search(4, 8, costs=_first_heavy(0.1), eager=True, method="heuristic", time_limit=2)
    assert found.seconds < 2 + 0.1


def test_a_layouts_own_order_gets_a_walk_where_a_builtin_of_it_is_faster():
    """At p = 4, m = 8, comm 0.1F, a 1.5x last stage, 0.6x 1F1B's activations, DualPipe's
    order with selective recompute (38.25) is the fastest of its layout before local search
    (list scheduling's best as fast), and no move of the walk from it is faster. List
    scheduling's best gets a walk of its own, and reaches 36.75 (each walk with its share of
    the moves, where the evaluations are counted, as of the time)."""
    heavy = CostModel(forward=1.5, backward=3.0, backward_input=1.5, backward_weight=1.5,
                      comm=0.1)  # fmt: skip
    costs = CostModel(comm=0.1, per_stage={3: heavy})
    found = search(4, 8, costs=costs, memory_limit=2.4, recompute=True, eager=True,
                   method="heuristic", max_evaluations=60, time_limit=600)  # fmt: skip
    assert found.source == "list scheduling + local search"
    assert placement_name(type(found.schedule)) == "two replicas"
    assert found.makespan < 38.25  # DualPipe's own, where its walk stays
    ranked = tune(num_stages=4, num_microbatches=8, num_chunks=(1, 2), costs=costs,
                  memory_limit=2.4, recompute=(False, True), eager=True).ranked  # fmt: skip
    assert found.makespan <= min(c.makespan for c in ranked) - 1


def test_list_scheduling_in_pairs_may_keep_room_for_a_pair():
    """At p = 8, m = 16, 1:2:1, comm 0.1, a 1.5x last stage, 1F1B's activations: in DualPipe's
    layout the last stage fills its wait for its first backward with the other replica's
    forwards, up to its limit, so its first backwards run alone (a forward beside one would not
    fit). Keeping room for one activation more (`_Rule.room_for_pair`: a forward runs alone only
    where one more would still fit) pairs them: the rules' fastest order runs more pairs on the
    last stage and takes 67.45 in the simulator where the rules without it take 69.0 at best."""
    heavy = CostModel(forward=1.5, backward=3.0, backward_input=1.5, backward_weight=1.5,
                      comm=0.1)  # fmt: skip
    costs = CostModel(comm=0.1, per_stage={7: heavy})
    family = _Family.of(get_schedule("dualpipe")(8, 16, 2), True)
    searcher = _searcher(8, 16, costs, 8.0, 2)
    scheduler = _ListScheduler(8, 16, family, costs, searcher._budgets(family), True, eager=True)
    rules = [rule for rule in _rules(family, random.Random(0), pairs=True)
             if rule.pairs and not rule.jitter]  # fmt: skip
    plain = [attrs.evolve(rule, owed=owed) for rule in rules for owed in (True, False)]
    roomy = [attrs.evolve(rule, room_for_pair=True) for rule in plain]
    assert roomy[0] in _variants(rules[0], family, True)

    (alone, alone_orders), (kept, kept_orders) = (
        _fastest_listed(searcher, scheduler, family, rules) for rules in (plain, roomy)
    )
    assert (alone, kept) == pytest.approx((69.0, 67.45))
    alone_pairs, kept_pairs = (
        sum(text[0] == "+" for text in orders[7]) for orders in (alone_orders, kept_orders)
    )
    assert kept_pairs > alone_pairs


def test_list_scheduling_in_pairs_may_pair_on_the_busiest_stages_only():
    """At p = 8, m = 16, 1:2:1, comm 0, a 1.5x last stage, 0.6x 1F1B's activations, in
    DualPipe-V's layout: a stage that pairs sends a forward's output at the pair's end, so every
    microbatch's round trip through the stages that pair holds its activations longer, and the
    light stages have the time to run their computes alone. Pairing on the busiest stage only
    (`_Rule.busiest_pairs`, one of `_variants`) the rules' fastest order takes 72.0 in the
    simulator, where pairing on every stage it takes 75.875; only the heavy stage runs pairs."""
    heavy = CostModel(forward=1.5, backward=3.0, backward_input=1.5, backward_weight=1.5)
    costs = CostModel(per_stage={7: heavy})
    family = _Family.of(get_schedule("dualpipe-v")(8, 16, 2), True)
    searcher = _searcher(8, 16, costs, 4.8, 2)
    scheduler = _ListScheduler(8, 16, family, costs, searcher._budgets(family), True, eager=True)
    rules = [rule for rule in _rules(family, random.Random(0), pairs=True)
             if rule.pairs and not rule.jitter]  # fmt: skip
    everywhere = [attrs.evolve(rule, owed=owed) for rule in rules for owed in (True, False)]
    busiest = [attrs.evolve(rule, busiest_pairs=True) for rule in everywhere]
    assert busiest[0] in _variants(rules[0], family, True)

    (paired, _), (alone, orders) = (
        _fastest_listed(searcher, scheduler, family, rules) for rules in (everywhere, busiest)
    )
    assert (paired, alone) == pytest.approx((75.875, 72.0))
    assert [any(text[0] == "+" for text in row) for row in orders] == [False] * 7 + [True]


def _fastest_listed(searcher, scheduler, family, rules):
    """`(simulated makespan, orders)` of the order `scheduler` estimates fastest over `rules`
    (`_timed`)."""
    orders = min(made for made in map(scheduler.run, rules) if made)[1]
    return _timed(searcher, family, orders), orders


def _timed(searcher, family, orders) -> float:
    """The simulated makespan of `orders` (of `family`, v = 2), checked to fit the budget."""
    p, m = searcher.p, searcher.m
    timeline = searcher._simulate(compile(_found_class(p, m, family, orders)(p, m, 2)), family)
    assert searcher._fits(timeline, family.share)
    return timeline.makespan
