"""`schedcc.search_exact`: the CP-SAT model is a relaxation of the simulator (every built-in's
timeline is one of its solutions, and none is below its proven bound), and its orders validate,
train exactly, fit their limit and meet its optimum where it is proven."""

from __future__ import annotations

import functools
import importlib
import random
import sys

import attrs
import pytest
from _builtin_schedules import names
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import stage_costs

import schedcc
from schedcc import CostModel, MemoryModel, ScheduleConfigError, ScheduleError
from schedcc.backends.reference import assert_matches_reference
from schedcc.ir import Copy, OverlappedBackward
from schedcc.passes.insert_offload import ByteLimit
from schedcc.registry import build_schedule, get_schedule
from schedcc.search import _Family, _found_class, _ListScheduler, _rules, search
from schedcc.search_bound import lower_bound
from schedcc.search_exact import ExactSolution, _Model, _room, require_ortools, solve_exact
from schedcc.tune import _per_chunk
from tests._models import batches, make_segments, mse, sgd

pytest.importorskip("ortools")

_SIZE = st.floats(0.0, 100.0)
#: random sizes of every kind (a gradient as large as its parameters, or not)
_MEMORY_MODELS = st.builds(
    MemoryModel,
    activations=st.floats(1.0, 100.0),
    parameters=_SIZE,
    optimizer=_SIZE,
    inputs=_SIZE,
    gradients=st.none() | _SIZE,
)


def _builtin_timelines(
    p: int, m: int, costs: CostModel, *, dp: int = 1, zero: int = 0, eager: bool = False
):
    """`(name, family, timeline, peak)` of each built-in at v = 1 and 2, with and without
    full recomputation, whose layout the model covers (looped or V, no replicas, overlapped
    pairs or offloads), timed eagerly with `eager`; `peak` in whole-stage microbatches, or
    with `costs.memory` each stage's peak bytes."""
    for name in names():
        for v in (1, 2):
            for recompute in (False, True):
                try:
                    schedule = build_schedule(get_schedule(name), p, m, num_chunks=v)
                    program = schedcc.compile(
                        schedule, recompute=recompute, data_parallel=dp, zero=zero
                    )
                except ScheduleError:
                    continue
                places = [schedule.placement(k) for k in range(schedule.num_segments)]
                kinds = [f for f in (_Family(v, False, True), _Family(v, True, True))
                         if f.segments(p) == places]  # fmt: skip
                ops = [op for row in program.stages for op in row]
                if type(schedule).num_replicas > 1 or not kinds:
                    continue
                if any(isinstance(op, (Copy, OverlappedBackward)) for op in ops):
                    continue
                timeline = schedcc.simulate(program, _per_chunk(costs, v), eager=eager)
                peak = max(timeline.peak_activations) / v
                if costs.memory is not None:
                    peak = list(timeline.peak_bytes)
                yield name, kinds[0], timeline, peak


def _as_solution(cp_model, model: _Model, timeline, name: str):
    """Solve `model` with every variable fixed at `timeline`'s values (`add_hint`): they must
    be a solution, at no more than its makespan. The solver, for its values."""
    model.add_hint(timeline)
    solver = cp_model.CpSolver()
    solver.parameters.fix_variables_to_their_hinted_value = True
    solver.parameters.num_workers = 1
    status = solver.solve(model.model)
    assert status == cp_model.OPTIMAL, (name, solver.status_name(status))
    assert solver.objective_value / model.scale <= timeline.makespan + 1e-9, name
    return solver


@settings(max_examples=4)
@given(p=st.integers(2, 3), m=st.integers(1, 3), data=st.data())
def test_every_builtin_timeline_is_a_solution_of_the_model(p, m, data):
    """[Note: the exact model]'s argument, checked: each built-in's simulated timeline, in
    ticks, satisfies every constraint of its placement's model under its own peak as the
    limit (in microbatches, or its peak bytes per stage under a random memory model, data
    parallelism and ZeRO), at no more than its simulated makespan; and its eager timeline
    ([Note: the eager exact model]) satisfies the eager model's."""
    cp_model = require_ortools()
    costs = data.draw(stage_costs(p))
    dp, zero = 1, 0
    if data.draw(st.booleans(), label="in bytes"):  # [Note: bytes in the exact model]
        costs = attrs.evolve(costs, memory=data.draw(_MEMORY_MODELS))
        dp, zero = data.draw(st.sampled_from([(1, 0), (2, 1), (2, 2), (2, 3)]), label="dp, zero")
    eager = data.draw(st.booleans(), label="eager")
    timelines = _builtin_timelines(p, m, costs, dp=dp, zero=zero, eager=eager)
    for name, family, timeline, peak in timelines:
        model = _Model(cp_model, p, m, costs, family, eager=eager)
        model.build(_room(peak, model, costs, data_parallel=dp, zero=zero), True, None, 0.0)
        _as_solution(cp_model, model, timeline, name)


@settings(max_examples=3)
@given(p=st.integers(2, 3), m=st.integers(2, 3), data=st.data())
def test_no_builtin_beats_the_exact_bound(p, m, data):
    """Random costs, comm and recomputation costs: no built-in of a covered layout is faster
    than CP-SAT's proven bound for its placement (solved without `lower_bound`'s help, at most
    0.3 s each), under no limit, or under one microbatch a stage for those that fit it."""
    costs = data.draw(stage_costs(p))
    timed = {}
    for name, family, timeline, peak in _builtin_timelines(p, m, costs):
        for limit in (None, 1.0):
            if limit is not None and peak > limit:
                continue
            key = (family.num_chunks, family.vshape, limit)
            if key not in timed:
                found = solve_exact(
                    p, m, costs, family, memory_limit=limit, recompute=True, time_limit=0.3
                )
                timed[key] = found.bound
            assert timed[key] <= timeline.makespan + 1e-9, (name, key, timed[key])
    assert timed  # 1f1b and zb-h1 are covered at every shape


@settings(max_examples=3)
@given(p=st.integers(2, 3), m=st.integers(2, 3), data=st.data())
def test_no_builtin_that_fits_the_bytes_beats_the_exact_bound(p, m, data):
    """[Note: bytes in the exact model]: under 1F1B's peak bytes per stage (random sizes of
    every kind), no built-in of a covered layout that fits them is faster than CP-SAT's proven
    bound for its placement under them."""
    costs = attrs.evolve(data.draw(stage_costs(p)), memory=data.draw(_MEMORY_MODELS))
    limit = schedcc.simulate(schedcc.compile(get_schedule("1f1b")(p, m)), costs).peak_bytes
    timed = {}
    for name, family, timeline, peak in _builtin_timelines(p, m, costs):
        if any(held > lim * (1 + 1e-9) for held, lim in zip(peak, limit)):
            continue
        key = (family.num_chunks, family.vshape)
        if key not in timed:
            found = solve_exact(
                p, m, costs, family, memory_limit=limit, recompute=True, time_limit=0.3
            )
            timed[key] = found.bound
        assert timed[key] <= timeline.makespan + 1e-9, (name, key, timed[key])
    assert timed  # 1f1b fits its own peak


def test_a_limit_in_bytes_is_the_limit_in_microbatches_it_stands_for():
    """With one byte per activation and nothing else, a limit of 1 byte is the limit of one
    microbatch: the same proven optimum (above the unlimited one), and the order fits the
    bytes when simulated, at that optimum; parameters and optimizer state take their bytes
    off the limit."""
    p, m = 2, 4
    family = _Family(1, False, True)
    costs = CostModel()
    counted = solve_exact(p, m, costs, family, memory_limit=1.0, recompute=True, time_limit=30)
    free = solve_exact(p, m, costs, family, time_limit=30)
    in_bytes = attrs.evolve(costs, memory=MemoryModel(activations=1.0))
    found = solve_exact(p, m, in_bytes, family, memory_limit=1.0, recompute=True, time_limit=30)
    assert (counted.optimal, found.optimal, free.optimal) == (True, True, True)
    assert found.makespan == pytest.approx(counted.makespan)
    assert found.makespan > free.makespan + 0.5
    cls = _found_class(p, m, family, found.orders)
    timeline = schedcc.simulate(schedcc.compile(cls(p, m, 1)), in_bytes)
    assert timeline.makespan == pytest.approx(found.makespan)
    assert max(timeline.peak_bytes) <= 1.0
    weighed = attrs.evolve(costs, memory=MemoryModel(activations=1.0, parameters=3.0,
                                                     optimizer=6.0, gradients=0.0))  # fmt: skip
    same = solve_exact(p, m, weighed, family, memory_limit=10.0, recompute=True, time_limit=30)
    assert same.optimal
    assert same.makespan == pytest.approx(found.makespan)


@functools.cache
def _exact(p, m, comm, limit):
    costs = CostModel(comm=comm, per_stage={p - 1: CostModel(forward=1.5, backward=3.0,
                      backward_input=1.5, backward_weight=1.5, comm=comm)})  # fmt: skip
    found = search(
        p, m, num_chunks=1, costs=costs, memory_limit=limit, recompute=limit is not None,
        time_limit=2, method="exact",
    )  # fmt: skip
    return costs, found


@pytest.mark.parametrize(("comm", "limit"), [(0.1, 1.5), (1.0, None)], ids=str)
def test_exact_orders_train_exactly_and_fit(comm, limit):
    """The order CP-SAT gives (its own comm groups where comm costs, [Note: the exact model])
    compiles, trains a float64 model as non-pipelined training does over two batches, fits
    the limit, and its bound is no lower than `lower_bound`'s."""
    p, m = 3, 4
    costs, found = _exact(p, m, comm, limit)
    family = _Family(1, False, True)
    assert found.method == "exact"
    assert found.bound >= lower_bound(p, m, costs, family, memory_limit=limit) - 1e-9
    assert found.makespan >= found.bound - 1e-9
    if limit is not None:
        assert max(found.peak_activations) <= limit
    solved = solve_exact(p, m, costs, family, memory_limit=limit, recompute=limit is not None,
                         time_limit=1, hint=found.timeline)  # fmt: skip
    cls = _found_class(p, m, family, solved.orders)
    schedule = cls(p, m, 1, num_batches=2)
    program = schedcc.compile(schedule, recompute=False)
    difference = assert_matches_reference(
        program, make_segments(p), mse, sgd, batches(2, 2 * m), atol=1e-10
    )
    assert difference <= 1e-10


@pytest.mark.parametrize(
    ("p", "m", "comm", "limit"),
    [(2, 3, 0.0, None), (3, 3, 0.0, 1.0), (3, 2, 0.5, None), (2, 3, 0.1, 1.0)],
    ids=str,
)
def test_a_proven_optimum_is_what_the_simulator_times(p, m, comm, limit):
    """Where CP-SAT proves its order optimal, the simulator times that order at the optimum:
    (the order carries the model's comm groups, and the simulator runs it no later than the
    model's times, [Note: the exact model])."""
    costs = CostModel(comm=comm, per_stage={0: CostModel(forward=1.3, backward=2.6, comm=comm)})
    family = _Family(1, False, True)
    found = solve_exact(p, m, costs, family, memory_limit=limit, recompute=limit is not None,
                        time_limit=30)  # fmt: skip
    assert found.optimal
    assert found.bound == pytest.approx(found.makespan)
    cls = _found_class(p, m, _Family(1, False, True), found.orders)
    timeline = schedcc.simulate(schedcc.compile(cls(p, m, 1)), costs)
    assert timeline.makespan == pytest.approx(found.makespan)
    if limit is not None:
        assert max(timeline.peak_activations) <= limit


def test_an_order_with_its_own_comm_groups_is_offloaded_keeping_them():
    """An order that places its own sends and receives, as CP-SAT's do ([Note: meeting time]),
    offloaded by the search to fit 1.5 microbatches a stage ([Note: the search's offloads]):
    the orders keep every send and receive beside the copies, the class written from them
    compiles to the same orders and makespan, and it fits."""
    import random
    import time

    from schedcc.search import _compute_orders, _Searcher

    p, m, v, limit = 3, 6, 2, 1.5
    costs = CostModel(comm=0.2, offload=0.25, reload=0.25)
    family = _Family(v, False, False)
    given = _compute_orders(
        schedcc.compile(get_schedule("interleaved-1f1b")(p, m, v)), sends=True
    )
    searcher = _Searcher(p, m, costs, (limit,) * p, False, True, 1, 0, time.monotonic() + 60,
                         None, random.Random(0))  # fmt: skip
    program = searcher._compile(family, given)
    timeline = schedcc.simulate(program, searcher._costs_of(family))
    assert max(timeline.peak_activations) / v > limit  # it does not fit as it is
    program, timeline, orders = searcher._offloaded(family, given, timeline)
    assert {"O", "L"} <= {text[0] for row in orders for text in row}
    comm = ("SA", "RA", "SG", "RG")
    assert [[t for t in row if t[:2] in comm] for row in orders] == [
        [t for t in row if t[:2] in comm] for row in given
    ]
    written = schedcc.compile(_found_class(p, m, family, orders)(p, m, v))
    assert _compute_orders(written, sends=True) == orders
    assert schedcc.simulate(written, timeline.costs).makespan == timeline.makespan
    assert max(timeline.peak_activations) / v <= limit


def test_the_exact_search_with_offloading_fits_and_stays_above_its_bound():
    """`method="exact"` with `offload=True` at one microbatch a stage (every placement's model
    also solved without the limit, and its orders offloaded): the order fits (its copies in
    the written orders where it offloads), replays to its makespan and stays above the bound.
    (That the bound leaves the memory terms out is checked on the heuristic search, whose
    answer does not vary.)"""
    p, m = 3, 4
    costs = CostModel(comm=0.1, offload=0.25, reload=0.25)
    found = search(p, m, costs=costs, memory_limit=1.0, recompute=True, offload=True,
                   method="exact", time_limit=2)  # fmt: skip
    assert found.method == "exact"
    cls = type(found.schedule)
    timeline = schedcc.simulate(schedcc.compile(cls(*cls.shape)), found.timeline.costs)
    assert timeline.makespan == found.makespan
    assert max(found.peak_activations) <= 1.0
    assert found.bound <= found.makespan + 1e-9


def test_without_ortools_exact_says_how_to_install_and_auto_falls_back(monkeypatch):
    """With ortools missing, method="exact" is a `ScheduleConfigError` naming the extra, and
    "auto" searches heuristically."""
    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)
    with pytest.raises(ScheduleConfigError, match=r"schedcc\[search\]"):
        search(2, 2, num_chunks=1, method="exact")
    assert search(2, 2, num_chunks=1, time_limit=2).method == "heuristic"
    with pytest.raises(ScheduleConfigError, match="method"):
        search(2, 2, num_chunks=1, method="optimal")


def test_auto_takes_the_exact_model_for_small_shapes_only():
    """"auto" solves the exact model at a small shape (its bound then the larger one) and not
    under an evaluation budget; the bound says where it came from."""
    small = search(2, 2, num_chunks=1, costs=CostModel(comm=1.0), time_limit=2)
    assert small.method == "exact"
    assert small.bound_from in ("lower_bound", "CP-SAT")
    budget = search(2, 2, num_chunks=1, costs=CostModel(comm=1.0), max_evaluations=20)
    assert budget.method == "heuristic"
    assert small.bound >= budget.bound - 1e-9


def test_auto_asks_for_ortools_only_where_the_exact_model_may_serve(monkeypatch):
    """Above `EXACT_MAX_PAIRS` "auto" is the heuristic without asking whether ortools imports
    (its import takes part of the search's time); at a small shape it asks."""
    search_module = importlib.import_module("schedcc.search")
    asked = []
    monkeypatch.setattr(search_module, "available", lambda: asked.append(True) or True)
    large = search(4, 17, num_chunks=1, time_limit=0.3)
    assert search_module.EXACT_MAX_PAIRS < 4 * 17
    assert (large.method, asked) == ("heuristic", [])
    small = search(2, 2, num_chunks=1, time_limit=0.3)
    assert (small.method, asked) == ("exact", [True])


def test_the_exact_time_goes_half_to_every_placement_then_to_the_fastest(monkeypatch):
    """[Note: the exact method's time]: each placement's model is solved once, in turn, in
    half the exact model's time; then the placement holding the fastest order is solved again,
    from that order, in the rest."""
    search_module = importlib.import_module("schedcc.search")  # the name is the function
    calls = []

    def recorded(p, m, costs, family, *, time_limit, hint, **kwargs):
        calls.append(((family.num_chunks, family.vshape), time_limit, hint))
        bound = 1.0 + len(calls) / 10  # proves nothing: every model stays open
        return ExactSolution(None, float("inf"), bound, False, 0.0)

    monkeypatch.setattr(search_module, "solve_exact", recorded)
    found = search(3, 3, costs=CostModel(comm=0.5), time_limit=3, method="exact", seed=2)
    placements = [placement for placement, _, _ in calls[:-1]]
    assert sorted(placements) == [(1, False), (2, False), (2, True)]
    (last, seconds, hint), first = calls[-1], sum(t for _, t, _ in calls[:-1])
    assert seconds >= 0.8 * first
    v = found.schedule.num_chunks
    vshape = v > 1 and found.schedule.placement(3) == (2, 1)  # segment p back on stage p - 1
    assert last == (v, vshape)  # the exact model found nothing: the heuristic's best holds
    assert hint is not None
    assert hint.makespan == pytest.approx(found.makespan)


@settings(max_examples=4)
@given(p=st.integers(2, 3), m=st.integers(2, 4), copy=st.sampled_from([0.0, 0.5, 2.0]),
       data=st.data())  # fmt: skip
def test_every_offloaded_builtin_timeline_is_a_solution_of_the_offload_model(p, m, copy, data):
    """[Note: offloads in the exact model]'s argument, checked: 1F1B, GPipe and interleaved
    1F1B offloaded down to one chunk activation a stage (`ByteLimit`), timed with random costs
    and copy costs, each satisfy every constraint of their placement's model with offloads
    under their own peak as the limit, at no more than their simulated makespan."""
    cp_model = require_ortools()
    costs = attrs.evolve(data.draw(stage_costs(p)), offload=copy, reload=copy)
    timed = 0
    for name, v in (("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2)):
        schedule = build_schedule(get_schedule(name), p, m, num_chunks=v)
        limit = ByteLimit(1.0, MemoryModel(activations=1.0))
        program = schedcc.compile(schedule, offload=limit)
        if not any(isinstance(op, Copy) for row in program.stages for op in row):
            continue
        timeline = schedcc.simulate(program, _per_chunk(costs, v))
        model = _Model(cp_model, p, m, costs, _Family(v, False, False))
        peak = max(timeline.peak_activations) / v
        model.build(_room(peak, model, costs, data_parallel=1, zero=0), False, None, 0.0,
                    offload=True)  # fmt: skip
        _as_solution(cp_model, model, timeline, name)
        timed += 1
    assert timed  # gpipe holds every microbatch: it offloads at m >= 2


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 3)])
def test_offloads_in_the_model_fit_one_microbatch_at_the_unlimited_optimum(p, m):
    """Under one microbatch a stage, copies of half a forward: with offloads the model's
    proven optimum is the unlimited one (without them it is far above), and its order, its
    copies placed where the model issues them, compiles, fits the limit, simulates within half
    a forward of it and trains a float64 model as non-pipelined training does."""
    family = _Family(1, False, False)
    costs = CostModel(offload=0.5, reload=0.5)
    free = solve_exact(p, m, costs, family, time_limit=10)
    kept = solve_exact(p, m, costs, family, memory_limit=1.0, time_limit=10)
    found = solve_exact(p, m, costs, family, memory_limit=1.0, offload=True, time_limit=10)
    assert (free.optimal, kept.optimal, found.optimal) == (True, True, True)
    assert found.makespan == pytest.approx(free.makespan)
    assert kept.makespan > free.makespan + 5
    cls = _found_class(p, m, family, found.orders)
    assert any(text.startswith("O") for row in cls.orders for text in row.split())
    timeline = schedcc.simulate(schedcc.compile(cls(p, m, 1)), costs)
    assert max(timeline.peak_activations) <= 1
    assert found.makespan - 1e-9 <= timeline.makespan <= found.makespan + 0.5
    schedule = cls(p, m, 1, num_batches=2)
    difference = assert_matches_reference(
        schedcc.compile(schedule), make_segments(p), mse, sgd, batches(2, 2 * m), atol=1e-10
    )
    assert difference <= 1e-10


def test_an_exact_search_that_may_offload_solves_the_limited_model_with_copies():
    """`search(offload=True, method="exact")` under a limit solves each placement's model with
    offloads: its order fits, stays above its bound, and is no slower than the offloaded F/B
    optimum simulates (within half a forward of the unlimited F/B one, above)."""
    costs = CostModel(offload=0.5, reload=0.5)
    found = search(3, 3, num_chunks=1, costs=costs, memory_limit=1, offload=True,
                   method="exact", time_limit=6)  # fmt: skip
    free = solve_exact(3, 3, costs, _Family(1, False, False), time_limit=30)
    assert free.optimal
    assert max(found.peak_activations) <= 1
    assert found.bound <= found.makespan + 1e-9
    assert found.makespan <= free.makespan + 0.5 + 1e-9


@pytest.mark.parametrize(
    ("p", "m", "comm", "limit"), [(2, 3, 0.5, None), (3, 3, 0.3, 1.0)], ids=str
)
def test_an_eager_proven_optimum_is_what_the_eager_simulator_times(p, m, comm, limit):
    """[Note: the eager exact model]: where CP-SAT proves the eager model's order optimal, the
    eager simulator times it at the optimum (no meetings: the compiler places the groups),
    below the rendezvous model's optimum where comm costs; the order trains exactly."""
    costs = CostModel(comm=comm, per_stage={0: CostModel(forward=1.3, backward=2.6, comm=comm)})
    family = _Family(1, False, True)
    # time to prove it on a loaded machine (CP-SAT stops at the proof: a second or two here)
    found = solve_exact(p, m, costs, family, memory_limit=limit, recompute=limit is not None,
                        time_limit=30, eager=True)  # fmt: skip
    assert found.optimal
    assert not any(text[:2] in ("SA", "RA", "SG", "RG") for row in found.orders for text in row)
    schedule = _found_class(p, m, family, found.orders)(p, m, 1)
    timeline = schedcc.simulate(schedcc.compile(schedule), costs, eager=True)
    assert timeline.makespan == pytest.approx(found.makespan)
    if limit is not None:
        assert max(timeline.peak_activations) <= limit
    rendezvous = solve_exact(p, m, costs, family, memory_limit=limit,
                             recompute=limit is not None, time_limit=30)  # fmt: skip
    assert rendezvous.optimal
    assert found.makespan < rendezvous.makespan - 1e-9
    twice = _found_class(p, m, family, found.orders)(p, m, 1, num_batches=2)
    difference = assert_matches_reference(
        schedcc.compile(twice), make_segments(p), mse, sgd, batches(2, 2 * m), atol=1e-10
    )
    assert difference <= 1e-10


def test_the_exact_search_eagerly_times_and_bounds_the_eager_timeline():
    """`search(method="exact", eager=True)`: its order (no comm written: the compiler places
    it) times eagerly at its makespan, above its bound, and no slower eagerly than the order the
    rendezvous search returns; its bound (CP-SAT's, where proven higher) is below every
    built-in's eager makespan."""
    costs = CostModel(comm=0.3, per_stage={2: CostModel(forward=1.5, backward=3.0, comm=0.3)})
    found = {
        eager: search(3, 3, num_chunks=1, costs=costs, method="exact", time_limit=4, eager=eager)
        for eager in (False, True)
    }
    eager = found[True]
    assert eager.eager
    assert eager.method == "exact"
    again = schedcc.simulate(eager.program, eager.timeline.costs, eager=True)
    assert again.makespan == pytest.approx(eager.makespan)
    assert eager.bound <= eager.makespan + 1e-9
    rendezvous = found[False]
    assert eager.makespan <= schedcc.simulate(
        rendezvous.program, rendezvous.timeline.costs, eager=True
    ).makespan + 1e-9
    for name in ("1f1b", "zb-h1", "gpipe"):  # the bound holds for what exists too, eagerly
        program = schedcc.compile(get_schedule(name)(3, 3))
        timed = schedcc.simulate(program, _per_chunk(costs, 1), eager=True)
        assert eager.bound <= timed.makespan + 1e-9, name


@pytest.mark.parametrize("eager", [False, True])
def test_the_exact_bound_counts_what_follows_the_last_compute_once(eager):
    """CP-SAT's model ends at the last compute, and the search adds what follows it (the step
    and the gradient norm, `closing`) to its bound once: started from `lower_bound` and cut off
    at the best order, both of which count it already, the model takes them less it. With a
    step and a norm as dear as a stage's computes (a small model's measured costs), the bound
    stays at or below the order found and every built-in."""
    costs = CostModel(forward=0.15, backward=0.25, step=0.45, norm=0.5)
    found = search(2, 4, num_chunks=1, costs=costs, grad_norm=True, method="exact",
                   time_limit=2, eager=eager)  # fmt: skip
    assert found.bound <= found.makespan + 1e-9
    for name in ("1f1b", "gpipe"):
        program = schedcc.compile(get_schedule(name)(2, 4), grad_norm=True)
        assert found.bound <= schedcc.simulate(program, costs, eager=eager).makespan + 1e-9
    assert found.bound > found.makespan * 0.9  # still a bound worth having


def _paired_timelines(p: int, m: int, costs: CostModel, data, *, dp: int = 1, zero: int = 0):
    """`(name, family, timeline, peak)` of DualPipe and DualPipe-V at (p, m) (with full
    recomputation or not) and of orders list scheduling makes in their layouts with overlapped
    pairs, timed eagerly; `peak` in whole-stage microbatches (one model replica's chunk each),
    or with `costs.memory` each stage's peak bytes."""
    for name in ("dualpipe", "dualpipe-v"):
        try:
            schedule = get_schedule(name)(p, m, 2)
        except ScheduleError:
            continue
        family = _Family.of(schedule, True)
        costs_of = _per_chunk(costs, family.share, family.segments(p))
        build = functools.partial(schedcc.compile, data_parallel=dp, zero=zero)
        programs = [(name, build(schedule))]
        if data.draw(st.booleans(), label=f"{name} recomputed"):
            programs.append((f"{name} recomputed", build(schedule, recompute=True)))
        scheduler = _ListScheduler(p, m, family, costs, None, False, eager=True)
        rules = [rule for rule in _rules(family, random.Random(0), pairs=True) if rule.pairs]
        for rule in data.draw(st.lists(st.sampled_from(rules), min_size=1, max_size=3)):
            made = scheduler.run(rule)
            cls = _found_class(p, m, family, made[1])
            programs.append((f"{name} {rule}", build(cls(p, m, 2))))
        for label, program in programs:
            timeline = schedcc.simulate(program, costs_of, eager=True)
            peak = max(timeline.peak_activations) / family.share
            yield label, family, timeline, peak if costs.memory is None else timeline.peak_bytes


@settings(max_examples=4)
@given(shape=st.sampled_from([(2, 4), (2, 5), (2, 6), (4, 8)]), data=st.data())
def test_every_paired_timeline_is_a_solution_of_the_paired_model(shape, data):
    """[Note: pairs in the exact model]'s argument, checked: each eager timeline of DualPipe's
    and DualPipe-V's layouts (the built-ins, recomputed or not, and orders list scheduling
    pairs at random), in ticks, satisfies every constraint of the model with pairs under its
    own peak as the limit (in microbatches, or its peak bytes per stage under a random memory
    model, data parallelism and ZeRO), at no more than its eager makespan; and the pairs it
    runs are the model's."""
    cp_model = require_ortools()
    p, m = shape
    costs = data.draw(stage_costs(p, updates=False))
    dp, zero = 1, 0
    if data.draw(st.booleans(), label="in bytes"):  # [Note: bytes in the exact model]
        costs = attrs.evolve(costs, memory=data.draw(_MEMORY_MODELS))
        dp, zero = data.draw(st.sampled_from([(1, 0), (2, 1), (2, 2), (2, 3)]), label="dp, zero")
    checked = 0
    for name, family, timeline, peak in _paired_timelines(p, m, costs, data, dp=dp, zero=zero):
        model = _Model(cp_model, p, m, costs, family, eager=True, pairs=True)
        model.build(_room(peak, model, costs, data_parallel=dp, zero=zero), True, None, 0.0)
        solver = _as_solution(cp_model, model, timeline, name)
        ran = sum(isinstance(op, OverlappedBackward) for _, op, _, _ in timeline.events)
        assert sum(solver.boolean_value(x) for x, *_ in model.overlapped) == ran, name
        checked += 1
    assert checked  # DualPipe-V runs at every shape here


@pytest.mark.parametrize(("p", "m", "limit"), [(2, 4, None), (2, 4, 2.0)], ids=str)
def test_a_proven_optimum_in_pairs_is_what_the_eager_simulator_times(p, m, limit):
    """[Note: pairs in the exact model]: in DualPipe's layout (two replicas, each microbatch
    through its own), with a heavy last stage and comm, CP-SAT proves an order in overlapped
    pairs optimal; the eager simulator times it at that optimum, within the limit; it beats
    the best order without pairs (the model without them, proven too) and DualPipe's own
    order (which holds more than the limit), and it trains exactly."""
    heavy = CostModel(forward=1.5, backward=3.0, backward_input=1.5, backward_weight=1.5,
                      comm=0.2)  # fmt: skip
    costs = CostModel(comm=0.2, per_stage={p - 1: heavy})
    schedule = get_schedule("dualpipe")(p, m, 2)
    family = _Family.of(schedule, True)
    solve = functools.partial(solve_exact, p, m, costs, family, memory_limit=limit,
                              recompute=limit is not None, time_limit=60, eager=True)  # fmt: skip
    found, alone = solve(pairs=True), solve(pairs=False)
    assert (found.optimal, alone.optimal) == (True, True)
    assert any(text.startswith("+B") for row in found.orders for text in row)
    program = schedcc.compile(_found_class(p, m, family, found.orders)(p, m, 2))
    timeline = schedcc.simulate(program, costs, eager=True)
    assert timeline.makespan == pytest.approx(found.makespan)
    if limit is not None:
        assert max(timeline.peak_activations) <= limit
    assert found.makespan < alone.makespan - 1e-9
    own = schedcc.simulate(schedcc.compile(schedule), costs, eager=True)
    if limit is None:  # DualPipe's own holds 3 a stage here: over the limit of 2
        assert found.makespan < own.makespan - 1e-9
    else:
        assert max(own.peak_activations) > limit
    twice = _found_class(p, m, family, found.orders)(p, m, 2, num_batches=2)
    parts = make_segments(p)  # each replica a copy of the model
    difference = assert_matches_reference(
        schedcc.compile(twice), parts + parts, mse, sgd, batches(2, 2 * m), atol=1e-10
    )
    assert difference <= 1e-10


def test_pairs_are_modelled_eagerly_only():
    with pytest.raises(ScheduleConfigError, match="eager"):
        solve_exact(2, 2, CostModel(), _Family(1, False, False), pairs=True, time_limit=1)


def test_the_exact_search_proves_an_order_in_pairs_optimal(monkeypatch):
    """`search(method="exact", eager=True)` solves the model of DualPipe's layout with pairs
    where an order of it fits: at p = 2, m = 4, a heavy last stage, the order list scheduling
    pairs (16.5, below DualPipe's own 17.25) is proven optimal, its bound CP-SAT's; the
    heuristic alone bounds it at `lower_bound`'s 16.35. `"auto"` solves it too where CP-SAT
    has 2 s ([Note: the exact model's pairs]: at the default 10 s), not at 3 s."""
    heavy = CostModel(forward=1.5, backward=3.0, backward_input=1.5, backward_weight=1.5,
                      comm=0.2)  # fmt: skip
    costs = CostModel(comm=0.2, per_stage={1: heavy})
    exact = search(2, 4, costs=costs, method="exact", time_limit=30, eager=True)
    assert any(text.startswith("+B") for row in exact.schedule.orders for text in row.split())
    assert (exact.makespan, exact.bound, exact.bound_from) == pytest.approx((16.5, 16.5, "CP-SAT"))
    heuristic = search(2, 4, costs=costs, method="heuristic", time_limit=30, eager=True)
    assert heuristic.makespan == pytest.approx(16.5)
    assert heuristic.bound == pytest.approx(16.35)
    module = importlib.import_module("schedcc.search")
    asked = []
    solve = module._Searcher.exact

    def exact_and_tell(self, *args, pairs=False, **kwargs):
        asked.append(pairs)
        return solve(self, *args, pairs=pairs, **kwargs)

    monkeypatch.setattr(module._Searcher, "exact", exact_and_tell)
    auto = search(2, 4, costs=costs, time_limit=10, eager=True)
    assert (auto.method, auto.bound_from, asked) == ("exact", "CP-SAT", [True])
    short = search(2, 4, costs=costs, time_limit=3, eager=True)
    assert (short.method, asked) == ("exact", [True, False])
    assert short.bound == pytest.approx(16.35)
