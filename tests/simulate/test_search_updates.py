"""The updates a run compiles, priced where orders are timed for it: `search` and `tune` take
`tied=` and `grad_norm=`, a trace records them and reads its collectives' costs without the
wait for the last member ([Note: a trace's updates], [Note: a collective's wait])."""

from __future__ import annotations

import json

import pytest

import schedcc
from schedcc import CostModel, ScheduleConfigError
from schedcc.costs import MeasuredUpdates, measured_updates
from schedcc.draw.chrome import cut_record
from schedcc.ir import GradNorm, ReduceTied
from schedcc.registry import get_schedule
from schedcc.search import search
from schedcc.tune import priced

#: A tied head's all-reduce and the norm's cost as much as a forward or two: not free.
_UPDATES = CostModel(reduce=1.5, norm=0.5, step=1.0, comm=0.1)


def _timed(schedule, costs: CostModel, **options) -> float:
    """`schedule`'s eager makespan, compiled with `options`, under `costs` (stage units)."""
    program = schedcc.compile(schedule, **options)
    return schedcc.simulate(program, priced(costs, schedule), eager=True).makespan


@pytest.mark.parametrize("v", [(1,), (2,), (1, 2)])
def test_a_search_times_the_program_the_run_compiles(v):
    """The found program carries the tied group's `ReduceTied` and the `GradNorm`, and its
    makespan is that of its order compiled with them: what the run trains, not the cheaper
    program without them."""
    updates = {"tied": [(0, -1)], "grad_norm": True}
    found = search(
        2, 4, num_chunks=v, costs=_UPDATES, eager=True, max_evaluations=30, **updates
    )
    ops = {type(op) for row in found.program.stages for op in row}
    assert {ReduceTied, GradNorm} <= ops
    assert found.program.tied == schedcc.compile(found.schedule, tied=[(0, -1)]).tied != ()
    assert found.makespan == pytest.approx(_timed(found.schedule, _UPDATES, **updates))
    without_norm = _timed(found.schedule, _UPDATES, tied=[(0, -1)])
    assert found.makespan >= without_norm + 0.5 - 1e-9  # the norm, on every stage's path


def test_a_search_with_updates_is_no_slower_than_the_builtins_with_them():
    """Ranked with the same updates, no built-in that fits beats the order found."""
    updates = {"tied": [(0, -1)], "grad_norm": True}
    found = search(4, 8, costs=_UPDATES, eager=True, max_evaluations=60, **updates)
    ranked = schedcc.tune(
        num_stages=4, num_microbatches=8, num_chunks=(1, 2), costs=_UPDATES, eager=True,
        **updates,
    )  # fmt: skip
    assert found.makespan <= ranked.ranked[0].makespan + 1e-9


def test_tune_prices_the_updates_of_every_program():
    """`tune(tied=, grad_norm=)` times each program with its collectives: 1F1B's makespan is
    its program's compiled with them."""
    updates = {"tied": [(0, -1)], "grad_norm": True}
    ranked = schedcc.tune(
        ["1f1b", "interleaved-1f1b"], num_stages=2, num_microbatches=4, num_chunks=(1, 2),
        costs=_UPDATES, eager=True, **updates,
    )  # fmt: skip
    for candidate in ranked.ranked:
        kwargs = {} if candidate.num_chunks == 1 else {"num_chunks": candidate.num_chunks}
        schedule = get_schedule(candidate.schedule)(2, 4, **kwargs)
        assert candidate.makespan == pytest.approx(_timed(schedule, _UPDATES, **updates))
        assert candidate.makespan > _timed(schedule, _UPDATES)


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda: search(2, 4, num_chunks=(1, 2), tied=[(0, 1)]), "names segments of one cut"),
        (lambda: search(2, 4, num_chunks=1, tied=[(0, 2)]), "not a segment index"),
        (lambda: search(2, 4, tied=[(0,)]), "fewer than two"),
        (lambda: search(2, 4, grad_norm=1), "grad_norm must be True or False"),
        (
            lambda: schedcc.tune(["1f1b"], num_stages=2, num_chunks=(1, 2), tied=[(0, 1)]),
            "names segments of one cut",
        ),
        (lambda: schedcc.tune(["1f1b"], num_stages=2, grad_norm="yes"), "grad_norm must be"),
    ],
)
def test_updates_that_do_not_hold_are_refused(call, says):
    """A tie named in segments of one cut, searched at several, is refused rather than tying
    different segments at each; so is a tie out of range or a non-boolean norm."""
    with pytest.raises(ScheduleConfigError, match=says):
        call()


def test_a_search_of_one_cut_takes_its_own_segment_indices():
    """Searching one cut, a tie may name any of its segments; DualPipe, which cuts the model
    in half as many, is left out of both, rather than tied elsewhere."""
    found = search(2, 4, num_chunks=2, tied=[(1, 2)], max_evaluations=10)
    assert found.program.tied == ((1, 2),)
    ranked = schedcc.tune(num_stages=2, num_microbatches=4, num_chunks=2, tied=[(1, 2)])
    assert {c.schedule for c in ranked.ranked} >= {"interleaved-1f1b", "zb-v"}
    assert "dualpipe" not in {c.schedule for c in ranked.ranked}
    assert any("names segments of a cut in 4" in s.reason for s in ranked.skipped)


def _trace(tmp_path, events, *, updates=None, stages=2):
    """A trace file of `events` (name, stage, start ms, duration ms), as `schedcc run --trace`
    writes one (measured, a cut of `stages` in one chunk each)."""
    schedule = get_schedule("1f1b")(stages, 4)
    metadata = {"measured": True, "device": "cpu", "cut": cut_record(schedule)}
    if updates is not None:
        metadata["updates"] = updates
    rows = [
        {"name": name, "ph": "X", "pid": 0, "tid": stage, "ts": start * 1e3, "dur": dur * 1e3}
        for name, stage, start, dur in events
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": rows, "otherData": metadata}))
    return path


def test_a_collective_is_read_from_its_last_members_start(tmp_path):
    """Stage 1 gets to the tied all-reduce 3 ms before stage 0 and waits for it: its measured
    6.5 ms hold 3 of waiting. Read back, each member's cost is its end less the last start, so
    a simulated step does not count the wait twice; a forward is read as it is."""
    events = [
        ("F0", 0, 0.0, 2.0), ("F0", 1, 2.0, 2.0),
        ("Tied0", 1, 4.0, 3.5), ("Tied0", 0, 6.0, 1.2),  # stage 0 arrives at 6
        ("Norm", 0, 7.2, 0.5), ("Norm", 1, 7.5, 0.4),  # stage 1 arrives at 7.5
        ("Tied0", 1, 20.0, 4.5), ("Tied0", 0, 23.0, 1.0),  # a second run of the step
        ("Norm", 0, 24.0, 0.6), ("Norm", 1, 24.5, 0.3),
    ]  # fmt: skip
    costs = CostModel.from_trace(_trace(tmp_path, events))
    assert costs.at(0).reduce == pytest.approx(1.1)  # medians of 1.2 and 1.0
    assert costs.at(1).reduce == pytest.approx((1.5 + 1.5) / 2)  # 7.5 - 6, 24.5 - 23
    assert costs.at(0).norm == pytest.approx((0.2 + 0.1) / 2)  # 7.7 - 7.5, 24.6 - 24.5
    assert costs.at(1).norm == pytest.approx((0.4 + 0.3) / 2)
    assert costs.at(1).forward == 2.0


def test_a_simulated_trace_reads_its_collectives_back_as_they_cost(tmp_path):
    """The simulator starts a collective's members together, so its trace's collectives read
    back at their costs, and a step simulated from them is the step that wrote it."""
    costs = CostModel(forward=1.0, backward=2.0, reduce=1.5, norm=0.7, step=0.5, comm=0.1)
    schedule = get_schedule("1f1b")(3, 6)
    program = schedcc.compile(schedule, tied=[(0, -1)], grad_norm=True)
    timeline = schedcc.simulate(program, costs, eager=True)
    path = timeline.to_chrome_trace(tmp_path / "sim.json")
    read = CostModel.from_trace(path)
    for stage in (0, 2):
        assert read.at(stage).reduce == pytest.approx(1.5)
    assert read.at(1).norm == pytest.approx(0.7)
    again = schedcc.simulate(program, read, eager=True)
    assert again.makespan == pytest.approx(timeline.makespan)


def test_a_trace_records_the_updates_its_run_compiled(tmp_path):
    """A record of ties within a cut of 4 reads the last segment as -1, whatever the cut; a
    tie of middle segments keeps them and says it holds at that cut only; no record, none."""
    last = measured_updates(_trace(tmp_path, [("F0", 0, 0, 1)], updates={
        "tied": [[0, 3]], "grad_norm": True}, stages=4))  # fmt: skip
    assert last == MeasuredUpdates(tied=((0, -1),), grad_norm=True, cut=4)
    assert last.cut_free
    middle = measured_updates(_trace(tmp_path, [("F0", 0, 0, 1)], updates={
        "tied": [[1, 3], [0, 2]], "grad_norm": False}, stages=4))  # fmt: skip
    assert middle.tied == ((1, -1), (0, 2))
    assert not middle.cut_free
    assert measured_updates(_trace(tmp_path, [("F0", 0, 0, 1)])) == MeasuredUpdates()


@pytest.mark.parametrize(
    "record", [{"tied": [[0, 1]]}, {"tied": "01", "grad_norm": True}, {"tied": [], "grad_norm": 1}]
)
def test_a_malformed_updates_record_is_refused(tmp_path, record):
    with pytest.raises(ScheduleConfigError, match="updates"):
        measured_updates(_trace(tmp_path, [("F0", 0, 0, 1)], updates=record))


def test_the_bound_counts_the_step_and_the_norm_that_close_a_run():
    """The stage whose compute ends last then takes the norm and its step ([Note: the lower
    bound], `closing`): 1F1B's 15 at p = 2, m = 4, plus 1.5, is the bound, and the optimum."""
    closing = CostModel(step=1.0, norm=0.5)
    kwargs = {"num_chunks": 1, "split_backward": False, "method": "heuristic", "eager": True}
    plain = search(2, 4, costs=CostModel(), max_evaluations=20, **kwargs)
    closed = search(2, 4, costs=closing, grad_norm=True, max_evaluations=20, **kwargs)
    assert plain.bound == plain.makespan == 15.0
    assert closed.bound == closed.makespan == 16.5
    without_norm = search(2, 4, costs=closing, max_evaluations=20, **kwargs)
    assert without_norm.bound == without_norm.makespan == 16.0
