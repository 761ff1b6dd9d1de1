"""A compute's fixed time: the part of each compute's cost that a finer cut does not divide and
a merged segment does not repeat, and how a measured trace gives it ([Note: a compute's fixed
time] in `schedcc/costs.py`)."""

from __future__ import annotations

import json

import attrs
import pytest

import schedcc
from schedcc import CostModel, ScheduleConfigError
from schedcc.draw.chrome import chrome_trace
from schedcc.ir import Forward, OptimizerStep
from schedcc.tune import priced

_FIXED = CostModel(
    forward=2.0,
    backward=4.0,
    backward_input=2.5,
    backward_weight=2.5,
    offload=1.0,
    fixed_forward=0.2,
    fixed_backward=0.5,
)


def test_a_finer_cut_divides_only_what_is_not_fixed():
    """At v = 2 a chunk costs half of what is not fixed, plus the fixed part whole; an unset
    recompute cost follows the forward, a copy has no fixed part; at v = 1 nothing changes."""
    interleaved = schedcc.get_schedule("interleaved-1f1b")(2, 4, num_chunks=2)
    chunk = priced(_FIXED, interleaved).at(1, 1)
    assert chunk.forward == pytest.approx(1.1)
    assert chunk.backward == pytest.approx(2.25)
    assert chunk.backward_input == chunk.backward_weight == pytest.approx(1.5)
    assert chunk.recompute is None
    assert chunk.offload == pytest.approx(0.5)
    assert priced(_FIXED, schedcc.get_schedule("1f1b")(2, 4)).at(1).forward == 2.0


def test_the_simulated_step_pays_each_chunk_s_fixed_part():
    """Interleaved 1F1B at v = 2 simulates as with each chunk's costs written out by hand."""
    schedule = schedcc.get_schedule("interleaved-1f1b")(2, 4, num_chunks=2)
    program = schedcc.compile(schedule)
    by_hand = CostModel(forward=1.1, backward=2.25, backward_input=1.5, backward_weight=1.5)
    for eager in (False, True):
        got = schedcc.simulate(program, priced(_FIXED, schedule), eager=eager).makespan
        assert got == pytest.approx(schedcc.simulate(program, by_hand, eager=eager).makespan)
    unfixed = attrs.evolve(_FIXED, fixed_forward=0.0, fixed_backward=0.0)
    assert schedcc.simulate(program, priced(unfixed, schedule)).makespan < got


def test_a_merged_segment_keeps_one_fixed_part():
    """Four measured segments of F = 1, B = 2 cut in two: each stage runs two merged, their
    sum less one fixed part (its stage's); a fixed part above a cost counts as the cost."""
    segments = [CostModel(forward=1.0, backward=2.0)] * 4
    costs = CostModel(
        per_segment=segments,
        per_stage={
            0: CostModel(fixed_forward=0.25, fixed_backward=0.5),
            1: CostModel(fixed_forward=5.0),
        },
    )
    placed = costs.placed([(0, 0), (1, 0)], 2)
    assert (placed.at(0).forward, placed.at(0).backward) == (1.75, 3.5)
    assert (placed.at(1).forward, placed.at(1).backward) == (1.0, 4.0)


def _event(name: str, stage: int, ts: float, dur: float, own: float | None = None) -> dict:
    args = {} if own is None else {"segment_us": own}
    return {"name": name, "ph": "X", "pid": 0, "tid": stage, "ts": ts, "dur": dur, "args": args}


def test_a_trace_reads_the_fixed_part_of_each_compute():
    """Per stage, the median of each compute's duration less its own time; the backward form
    the trace lacks is read with it (I = W = the rest halved, plus the fixed part whole)."""
    events = [
        _event("F0", 0, 0, 2000, 1800),
        _event("F1", 0, 2000, 2100, 1900),
        _event("F2", 0, 4100, 2000, 1700),
        _event("B0", 0, 6100, 3000, 2700),
        _event("Step", 0, 9100, 500),
    ]
    read = CostModel.from_trace(events)
    assert read.at(0).fixed_forward == pytest.approx(0.2)
    assert read.at(0).fixed_backward == pytest.approx(0.3)
    assert read.at(0).backward_input == pytest.approx((3.0 - 0.3) / 2 + 0.3)
    assert read.fixed_forward == pytest.approx(0.2)
    caller = CostModel.from_trace(events, fixed_forward=0.0)
    assert caller.at(0).fixed_forward == 0.0
    assert caller.at(0).fixed_backward > 0
    bare = CostModel.from_trace([{**e, "args": {}} for e in events])
    assert (bare.at(0).fixed_forward, bare.at(0).fixed_backward) == (0.0, 0.0)


def test_a_stage_read_from_a_finer_cut_counts_one_fixed_part():
    """A trace of two chunks a stage: the stage's forward at v = 1 is the chunks' sum less one
    fixed part, and priced back at v = 2 each chunk is its own again (its segment's)."""
    cut = {"num_stages": 1, "num_chunks": 2, "num_replicas": 1, "segments": [[0, 1]]}
    events = [
        _event("F0", 0, 0, 1200, 1000),
        _event("F0.1", 0, 1200, 1100, 900),
        _event("B0.1", 0, 2300, 2000, 1800),
        _event("B0", 0, 4300, 2400, 2200),
    ]
    read = CostModel.from_trace({"traceEvents": events, "otherData": {"cut": cut}})
    assert read.at(0).forward == pytest.approx(1.2 + 1.1 - 0.2)
    assert read.at(0).backward == pytest.approx(2.0 + 2.4 - 0.2)
    schedule = schedcc.get_schedule("interleaved-1f1b")(1, 1, num_chunks=2)
    chunks = priced(read, schedule)
    assert (chunks.at(0, 0).forward, chunks.at(0, 1).forward) == pytest.approx((1.2, 1.1))


@pytest.mark.parametrize("bad", [-1.0, "fast", True])
def test_a_malformed_own_time_is_a_config_error(bad):
    with pytest.raises(ScheduleConfigError, match="segment_us"):
        CostModel.from_trace([_event("F0", 0, 0, 1000, bad)])


@pytest.mark.parametrize("field", ["fixed_forward", "fixed_backward"])
def test_a_negative_fixed_part_is_refused(field):
    with pytest.raises(ScheduleConfigError):
        CostModel(**{field: -0.1})


def test_a_trace_writes_a_compute_s_own_time_where_given():
    """A fifth element of an event is its own time (in the events' unit), written as
    `segment_us`; None, or none at all, writes nothing."""
    trace = chrome_trace(
        [(0, Forward(0), 0.0, 2.0, 1.5), (0, OptimizerStep(), 2.0, 3.0, None)], unit_us=1000
    )
    args = {e["name"]: e["args"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert args["F0"]["segment_us"] == 1500.0
    assert "segment_us" not in args["Step"]
    json.dumps(trace)  # still plain JSON
