"""[Note: the stage relaxation]: a stage's time-indexed linear relaxation bounds every order,
and where `lower_bound` is loose in overlapped pairs under a limit it proves the order found
optimal."""

from __future__ import annotations

import importlib
import math
import time

import attrs
import pytest
from _builtin_schedules import names
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import stage_costs

import schedcc
from schedcc import CostModel, ScheduleConfigError, ScheduleError
from schedcc.ir import BackwardInput, Copy, OverlappedBackward
from schedcc.registry import build_schedule, get_schedule
from schedcc.search import _Family
from schedcc.search_bound import _Bound, closing
from schedcc.search_relax import _Pipeline, _Stage, relaxed_pipeline_bound, relaxed_stage_bound
from schedcc.tune import _per_chunk

pytest.importorskip("ortools")

#: 1:2:1, comm 1F, a 1.5x last stage (the grid of benchmarks/search_grid.py)
HEAVY_LAST = CostModel(
    forward=1.0, backward=2.0, backward_input=1.0, backward_weight=1.0, comm=1.0,
    per_stage={3: CostModel(
        forward=1.5, backward=3.0, backward_input=1.5, backward_weight=1.5, comm=1.0
    )},
)  # fmt: skip

#: 1:2:1, comm 0, a 1.5x last stage at p = 2
HEAVY_SECOND = CostModel(
    forward=1.0, backward=2.0, backward_input=1.0, backward_weight=1.0, comm=0.0,
    per_stage={1: CostModel(
        forward=1.5, backward=3.0, backward_input=1.5, backward_weight=1.5, comm=0.0
    )},
)  # fmt: skip


@pytest.mark.parametrize("split", [False, True])
def test_the_relaxation_raises_a_stage_the_sums_leave_low(split):
    """DualPipe's stage 3 at p = 4, m = 8, 0.6x 1F1B's activations (two a stage), eagerly:
    the analytic bound is 36.0, the relaxation needs 39.0 (and no more, given room above)."""
    assert _dualpipe_stage(4, 8, HEAVY_LAST, split, 3, 0.6, 40.0) == pytest.approx((36.0, 39.0))


def _dualpipe_stage(p, m, costs, split, s, limit, high) -> tuple[float, float]:
    """Stage s of DualPipe's layout in pairs, eagerly, at `limit` times 1F1B's activations:
    its analytic bound and its relaxation's, up to `high`."""
    family = _Family.of(build_schedule(get_schedule("dualpipe"), p, m), split)
    bound = _Bound(p, m, costs, family, True, eager=True)
    rooms = bound.rooms(s, limit * p, 1, 0)
    low = bound.stage(s, rooms, True)
    deadline = time.monotonic() + 120
    return low, relaxed_stage_bound(bound, s, rooms, True, low, high, deadline)


def test_a_backward_leaves_its_tail_before_the_end():
    """DualPipe's layout at p = 2, m = 4, in pairs, whole backwards, a 1.5x last stage, 1F1B's
    activations: stage 0 holds replica B's last segment, whose backwards' outputs still run
    through stage 1 (1.5 each at the least) before the run ends. The sums bound stage 0 at
    11.5; its relaxation, each of those backwards ended a tail before the end, at 13.0 (12.5
    where they may end the run)."""
    assert _dualpipe_stage(2, 4, HEAVY_SECOND, False, 0, 1.0, 15.0) == pytest.approx((11.5, 13.0))


def test_the_whole_pipelines_program_proves_more_than_each_stages(monkeypatch):
    """[Note: the whole pipeline's relaxation] p = 2, m = 2, the looped placement at v = 2,
    split backwards, 1:2:1, a 1.5x last stage, 0.6x 1F1B's activations (two chunk
    activations a stage): stage 1's own program admits its sums' 10.0, the two stages'
    programs in one need 10.25 (what CP-SAT proves optimal for that layout)."""
    assert _looped_at_p_2() == pytest.approx((8.25, 10.0, 10.25))
    # beyond `MAX_PIPELINE_SIZE` counts the program is not built
    monkeypatch.setattr(importlib.import_module("schedcc.search_relax"), "MAX_PIPELINE_SIZE", 100)
    assert _looped_at_p_2()[2] == 10.0


def _looped_at_p_2() -> tuple[float, float, float]:
    """The looped layout above: stage 0's and stage 1's programs' bounds, and the whole
    pipeline's."""
    bound = _Bound(2, 2, HEAVY_SECOND, _Family(2, False, True), False, eager=True)
    rooms = bound.all_rooms([0.6 * 2] * 2, 1, 0)
    deadline = time.monotonic() + 60
    lows = [bound.stage(s, rooms[s], True) for s in range(2)]
    alone = [relaxed_stage_bound(bound, s, rooms[s], True, lows[s], 15.0, deadline) for s in (0, 1)]
    return *alone, relaxed_pipeline_bound(bound, rooms, True, 10.0, 15.0, deadline)


def test_glop_solves_where_ortools_lacks_highs(monkeypatch):
    """The programs are solved by HiGHS's interior point method; an ortools built without
    HiGHS solves them by GLOP, to the same bounds."""
    from ortools.linear_solver import pywraplp

    create, asked = pywraplp.Solver.CreateSolver, []

    def without_highs(name):
        asked.append(name)
        return None if name == "HIGHS" else create(name)

    monkeypatch.setattr(pywraplp.Solver, "CreateSolver", without_highs)
    assert _looped_at_p_2() == pytest.approx((8.25, 10.0, 10.25))
    assert "GLOP" in asked


def test_the_whole_pipelines_program_reaches_p_4():
    """DualPipe's layout at p = 4, m = 8, split backwards in pairs, 1:2:1, comm 0, a 1.5x last
    stage, 0.6x 1F1B's activations: stage 3's own program proves 35.25, the whole pipeline's
    (about 11,000 counts) 35.5 under the best order's 36.0."""
    costs = attrs.evolve(
        HEAVY_LAST, comm=0.0, per_stage={3: attrs.evolve(HEAVY_LAST.per_stage[3], comm=0.0)}
    )
    family = _Family.of(build_schedule(get_schedule("dualpipe"), 4, 8), True)
    bound = _Bound(4, 8, costs, family, True, eager=True)
    rooms = bound.all_rooms([0.6 * 4] * 4, 1, 0)
    deadline = time.monotonic() + 120
    low = bound.stage(3, rooms[3], True)
    alone = relaxed_stage_bound(bound, 3, rooms[3], True, low, 36.0, deadline)
    whole = relaxed_pipeline_bound(bound, rooms, True, alone, 36.0, deadline)
    assert (alone, whole) == pytest.approx((35.25, 35.5))


def test_a_step_off_the_costs_grid_rounds_the_stages_durations_least():
    """At 1:1.5:0.8 a 1.3x stage computes in 0.91, 1.04, 1.3 and 1.95: their common step 0.01
    would take 2,730 steps to 27.3, and its multiple 0.08 rounds 0.91 down to 0.88; 0.13
    divides them all in 210 steps ([Note: the stage relaxation])."""
    heavy = CostModel(
        forward=1.3, backward=1.95, backward_input=0.91, backward_weight=1.04, comm=0.0
    )
    costs = CostModel(
        forward=1.0, backward=1.5, backward_input=0.7, backward_weight=0.8, comm=0.0,
        per_stage={0: heavy},
    )  # fmt: skip
    family = _Family.of(build_schedule(get_schedule("dualpipe"), 4, 8), True)
    bound = _Bound(4, 8, costs, family, True, eager=True)
    stage = _Stage(bound, bound.on[0], bound.rooms(0, 0.6 * 4, 1, 0), True)
    assert stage.step(27.3) == pytest.approx(0.13)
    assert stage.step(4.0) == pytest.approx(0.01)  # 400 steps: the common step
    assert all(d / 0.13 == pytest.approx(round(d / 0.13)) for d in stage.classes.values())


def test_microbatches_of_unequal_sizes_are_left_to_the_sums():
    """Where microbatches cost unequal factors the relaxation claims nothing: its computes
    cost their segment's costs ([Note: the stage relaxation])."""
    costs = attrs.evolve(HEAVY_LAST, per_microbatch=(1.0, 0.5) * 4)
    family = _Family.of(build_schedule(get_schedule("dualpipe"), 4, 8), True)
    bound = _Bound(4, 8, costs, family, True, eager=True)
    rooms = bound.rooms(3, 0.6 * 4, 1, 0)
    low = bound.stage(3, rooms, True)
    assert relaxed_stage_bound(bound, 3, rooms, True, low, 50.0, time.monotonic() + 60) == low


def test_search_proves_its_order_in_pairs_optimal():
    """`search(..., prove=S)`: the order found in DualPipe's layout takes 39.0, and the bound,
    36.0 without the relaxation, is 39.0 with it."""
    shape = {"costs": HEAVY_LAST, "memory_limit": 0.6 * 4, "recompute": True, "eager": True}
    result = schedcc.search(4, 8, **shape, time_limit=3, prove=120)
    assert result.bound == pytest.approx(39.0)
    assert result.bound_from == "relaxation"
    assert result.makespan >= result.bound - 1e-9
    assert any(b.bound_from == "relaxation" and b.pairs for b in result.layout_bounds)
    plain = schedcc.search(4, 8, **shape, time_limit=1, max_evaluations=30)
    assert plain.bound == pytest.approx(36.0)


def test_search_bounds_a_small_shape_in_pairs_by_the_whole_pipeline():
    """p = 2, m = 4, 1:2:1, a 1.5x last stage, 0.6x 1F1B's activations: the sums bound the V
    in pairs at 17.77 and its busiest stage's program at 18.75 (CP-SAT proves nothing above
    17.77 in 300 s); the whole pipeline's program proves 19.0."""
    shape = {"costs": HEAVY_SECOND, "memory_limit": 0.6 * 2, "recompute": True, "eager": True}
    result = schedcc.search(2, 4, **shape, time_limit=3, prove=120)
    assert result.bound == pytest.approx(19.0)
    assert result.bound_from == "relaxation"
    assert result.makespan >= result.bound - 1e-9


def test_prove_takes_seconds_and_needs_ortools(monkeypatch):
    for bad in (-1, math.inf, True, "10"):
        with pytest.raises(ScheduleConfigError, match="prove must be seconds"):
            schedcc.search(2, 2, prove=bad)

    def missing():
        raise ScheduleConfigError("the exact search needs ortools's CP-SAT solver")

    monkeypatch.setattr(importlib.import_module("schedcc.search"), "require_ortools", missing)
    with pytest.raises(ScheduleConfigError, match="ortools"):
        schedcc.search(2, 2, prove=1)


def _builtins(p: int, m: int, costs: CostModel, eager: bool):
    """`(name, family, overlapped, timeline, peak)` of each built-in at v = 1 and 2, with and
    without full recomputation, that offloads nothing; `peak` per stage in whole-stage
    microbatches."""
    for name in names():
        for v in (1, 2):
            for recompute in (False, True):
                try:
                    schedule = build_schedule(get_schedule(name), p, m, num_chunks=v)
                    program = schedcc.compile(schedule, recompute=recompute)
                except ScheduleError:
                    continue
                ops = [op for row in program.stages for op in row]
                if any(isinstance(op, Copy) for op in ops) or schedule.num_parts != 1:
                    continue
                split = any(isinstance(op, BackwardInput) for op in ops)
                family = _Family.of(schedule, split)
                place = family.segments(p)
                timeline = schedcc.simulate(
                    program, _per_chunk(costs, family.share, place), eager=eager
                )
                peak = [n / family.share for n in timeline.peak_activations]
                paired = any(isinstance(op, OverlappedBackward) for op in ops)
                yield name, family, paired, timeline, peak


@settings(max_examples=4, deadline=None)
@given(p=st.integers(2, 3), m=st.integers(2, 4), data=st.data())
def test_every_builtin_is_a_point_of_each_stages_relaxation(p, m, data):
    """Random costs, comm, overlap and recomputation costs: each built-in's simulated order,
    under its own peak activations as the limit, ends each stage's computes no sooner than
    that stage's relaxation admits (on the costs' own steps or, off them, durations rounded
    down), with overlapped pairs where it runs them; and the whole pipeline's program admits
    it too."""
    costs = data.draw(stage_costs(p))
    eager = data.draw(st.booleans(), label="eager")
    timelines = list(_builtins(p, m, costs, eager))
    chosen = data.draw(st.lists(st.sampled_from(timelines), min_size=1, max_size=2, unique_by=id))
    end = closing(costs, p)
    for name, family, paired, timeline, peak in chosen:
        limited = data.draw(st.booleans(), label="limited")
        bound = _Bound(p, m, costs, family, paired, eager)
        last = timeline.makespan - end
        for s in range(p):
            rooms = bound.rooms(s, peak[s], 1, 0) if limited else None
            stage = _Stage(bound, bound.on[s], rooms, True)
            assert _admits_by(stage, last), (name, s, limited)
        rooms = bound.all_rooms(peak, 1, 0) if limited else None
        assert _admits_by(_Pipeline(bound, rooms, True), last), (name, limited)


def _admits_by(program, last: float) -> bool:
    """Whether `program` (a stage's or the pipeline's) has a point whose computes all end by
    `last`, on its own step (rounded down)."""
    dt = program.step(last)
    return program.admits(math.floor(last / dt + 1e-9), dt, time.monotonic() + 60)
