"""A step's first computes: what a stage's first forward and first backward take beyond their
cost, in both simulators and read from a trace ([Note: a step's first computes])."""

from __future__ import annotations

import json

import pytest

import schedcc
from schedcc import CostModel, ScheduleConfigError
from schedcc.costs import warmups
from schedcc.tune import priced

_WARM = CostModel(warmup_forward=0.5, warmup_backward=0.25)


@pytest.mark.parametrize("eager", [False, True])
def test_a_stage_s_first_forward_and_backward_warm_up(eager):
    """1F1B at p = 2, m = 4 (15 at F = 1, B = 2): every stage's first forward and first
    backward lie on the critical path, so the step takes 2 * (0.5 + 0.25) more; no other
    compute changes."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    timeline = schedcc.simulate(program, _WARM, eager=eager)
    assert timeline.makespan == pytest.approx(16.5)
    durations = {
        (e.stage, str(e.instruction)): e.end - e.start
        for e in timeline.events
        if e.instruction.group == "compute"
    }
    for s in (0, 1):
        assert durations[s, "F0"] == pytest.approx(1.5)
        assert durations[s, "B0"] == pytest.approx(2.25)
        assert durations[s, "F1"] == pytest.approx(1.0)
        assert durations[s, "B3"] == pytest.approx(2.0)


def test_the_first_of_each_kind_in_program_order_warms_up():
    """GPipe's stage 0 runs F0 first and B3 first of its backwards; zb-h1's first backward is
    an input gradient; a stage without warm-up has none."""
    gpipe = schedcc.compile(schedcc.get_schedule("gpipe")(2, 4))
    costs = CostModel(per_stage={0: _WARM})
    warm = warmups(costs, gpipe.stages)
    found = {(s, str(gpipe.stages[s][pos])): extra for (s, pos), extra in warm.items()}
    assert found == {(0, "F0"): 0.5, (0, "B3"): 0.25}
    zb = schedcc.compile(schedcc.get_schedule("zb-h1")(2, 4))
    first = {str(zb.stages[s][pos]) for (s, pos) in warmups(_WARM, zb.stages)}
    assert first == {"F0", "I0"}


def test_a_trace_reads_each_stage_s_warm_up_back(tmp_path):
    """Simulated with its own warm-ups per stage, a trace gives them back, and the step with
    them; the caller's value wins over the trace's."""
    costs = CostModel(forward=1.5, backward=2.5, comm=0.25, per_stage={
        0: CostModel(forward=1.5, backward=2.5, comm=0.25, warmup_forward=0.75),
        1: CostModel(forward=2.0, backward=3.0, comm=0.25, warmup_backward=1.25)})  # fmt: skip
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 8))
    timeline = schedcc.simulate(program, costs, eager=True)
    path = timeline.to_chrome_trace(tmp_path / "sim.json")
    read = CostModel.from_trace(path)
    assert (read.at(0).warmup_forward, read.at(0).warmup_backward) == pytest.approx((0.75, 0))
    assert (read.at(1).warmup_forward, read.at(1).warmup_backward) == pytest.approx((0, 1.25))
    assert schedcc.simulate(program, read, eager=True).makespan == pytest.approx(timeline.makespan)
    cold = CostModel.from_trace(path, warmup_forward=0.0)
    assert cold.at(0).warmup_forward == 0.0
    assert cold.at(1).warmup_backward == pytest.approx(1.25)


def test_a_trace_of_several_runs_takes_the_median_first_compute(tmp_path):
    """Runs split at each track's `Step`: three runs whose first forward took 0.5, 0.25 and 2.0
    more than the usual 1.0 read as 0.5; a trace without a first compute apart reads 0."""
    rows = []
    for run, extra in enumerate((0.5, 0.25, 2.0)):
        t = 100.0 * run
        for i, dur in enumerate((1.0 + extra, 1.0, 1.0, 1.0)):
            rows.append(("F" + str(i), t, dur))
            t += dur
        rows.append(("Step", t, 0.5))
    events = [
        {"name": name, "ph": "X", "pid": 0, "tid": 0, "ts": ts * 1e3, "dur": dur * 1e3}
        for name, ts, dur in rows
    ]
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(events))
    assert CostModel.from_trace(path).at(0).warmup_forward == pytest.approx(0.5)
    assert CostModel.from_trace(path).at(0).forward == pytest.approx(1.0)
    steady = [e for e in events if e["name"] != "F0"]
    path.write_text(json.dumps(steady))
    assert CostModel.from_trace(path).at(0).warmup_forward == 0.0


def test_a_negative_warm_up_is_refused():
    with pytest.raises(ScheduleConfigError, match="warmup_forward"):
        CostModel(warmup_forward=-1.0)


def test_the_bound_counts_each_stage_s_warm_up():
    """The warm-ups are work a stage runs: at p = 2, m = 4, F/B orders, the bound 15 (1F1B's
    makespan, the optimum) rises by a stage's 0.75 of warm-ups; the order found, no slower than
    1F1B with them (16.5), stays above it."""
    kwargs = {"num_chunks": 1, "split_backward": False, "eager": True, "method": "heuristic"}
    found = schedcc.search(2, 4, costs=_WARM, max_evaluations=20, **kwargs)
    assert found.bound == pytest.approx(15.75)
    assert found.bound <= found.makespan <= 16.5


def test_each_chunk_s_first_computes_warm_up_with_its_share():
    """A chunk holds its share of the stage's parameters: interleaved 1F1B at v = 2 warms up
    the first forward and first backward of each chunk on each stage, each with half of the
    stage's warm-up (its costs at v = 1)."""
    schedule = schedcc.get_schedule("interleaved-1f1b")(2, 4, num_chunks=2)
    program = schedcc.compile(schedule)
    warm = warmups(priced(_WARM, schedule), program.stages)
    found = {(s, str(program.stages[s][pos])): extra for (s, pos), extra in warm.items()}
    for s in (0, 1):
        assert found[s, "F0"] == found[s, "F0.1"] == pytest.approx(0.25)
        assert found[s, "B0"] == found[s, "B0.1"] == pytest.approx(0.125)
    assert len(found) == 8


def test_a_trace_at_v_2_reads_back_each_stage_s_warm_up(tmp_path):
    """Simulated at v = 2 from a stage's warm-ups, each chunk's share of them, a trace (with its
    cut) reads back the stage's: the chunks' summed; priced again, the same step."""
    costs = CostModel(
        forward=2.0,
        backward=4.0,
        per_stage={0: CostModel(forward=2.0, backward=4.0, warmup_forward=1.0),
                   1: CostModel(forward=2.0, backward=4.0, warmup_backward=0.5)},
    )  # fmt: skip
    schedule = schedcc.get_schedule("interleaved-1f1b")(2, 8, num_chunks=2)
    program = schedcc.compile(schedule)
    timeline = schedcc.simulate(program, priced(costs, schedule), eager=True)
    read = CostModel.from_trace(timeline.to_chrome_trace(tmp_path / "v2.json"))
    assert (read.at(0).warmup_forward, read.at(0).warmup_backward) == pytest.approx((1.0, 0))
    assert (read.at(1).warmup_forward, read.at(1).warmup_backward) == pytest.approx((0, 0.5))
    again = schedcc.simulate(program, priced(read, schedule), eager=True)
    assert again.makespan == pytest.approx(timeline.makespan)
