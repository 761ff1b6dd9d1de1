"""Per-segment costs ([Note: segment costs]): each segment's compute costs its own wherever a
placement puts it, merged at a coarser cut, read back from a trace's cut record, and what
`tune` and `search` price orders of another placement with."""

from __future__ import annotations

import json

import attrs
import pytest
from _builtin_schedules import builtins
from hypothesis import given, settings
from hypothesis import strategies as st

import schedcc
from schedcc import CostModel, ScheduleConfigError
from schedcc.costs import kind_cost
from schedcc.ir import COMPUTE, OverlappedBackward
from schedcc.registry import build_schedule, get_schedule
from schedcc.semantics import Layout
from schedcc.tune import _per_chunk

costs_drawn = st.floats(0.25, 4.0, allow_nan=False).map(lambda x: round(x, 2))
segment_costs = st.builds(
    CostModel,
    forward=costs_drawn,
    backward=costs_drawn,
    backward_input=costs_drawn,
    backward_weight=costs_drawn,
)


def _program(name: str, p: int, m: int, v: int):
    try:
        schedule = build_schedule(get_schedule(name), p, m, num_chunks=v)
    except ScheduleConfigError:
        return None
    return schedcc.compile(schedule)


def _durations_by_segment(timeline, cut: int) -> list[tuple[int, type, float]]:
    """`(replica segment, class, duration)` of each compute of `timeline` (overlapped pairs,
    which share a forward's time, left out)."""
    layout = Layout.of(timeline.program.schedule)
    return [
        (layout.segment[e.stage][e.instruction.chunk] % cut, type(e.instruction), e.end - e.start)
        for e in timeline.events
        if isinstance(e.instruction, COMPUTE) and not isinstance(e.instruction, OverlappedBackward)
    ]


@settings(max_examples=30)
@given(
    schedule=st.sampled_from([b.name for b in builtins()]),
    p=st.integers(2, 4),
    v=st.integers(1, 2),
    merge=st.integers(1, 2),
    data=st.data(),
)
def test_each_compute_costs_its_segments_own_in_every_builtin(schedule, p, v, merge, data):
    """Under `per_segment` costs every built-in's computes cost their segment's (copies of one
    replica's segment alike), and with twice as many segments as the program has, the sum of
    the two it merges: the simulator places them by the program's own layout."""
    program = _program(schedule, p, 2 * p, v)
    if program is None:
        return
    cut = p * v // type(program.schedule).num_replicas
    segments = data.draw(st.lists(segment_costs, min_size=cut * merge, max_size=cut * merge))
    timeline = schedcc.simulate(program, CostModel(per_segment=segments))
    for k, cls, duration in _durations_by_segment(timeline, cut):
        merged = segments[k * merge : (k + 1) * merge]
        assert duration == pytest.approx(sum(kind_cost(model, cls) for model in merged))


def test_a_cut_the_segments_do_not_divide_into_reads_the_stage_costs():
    """Four segments' costs say nothing of a cut in 3 or 8: such a program reads the per-stage
    costs as before (no split of a segment is known)."""
    costs = CostModel(forward=1.5, per_segment=[CostModel(forward=9.0)] * 4)
    placed = costs.placed([(0, 0), (1, 0), (2, 0)])
    assert placed.per_segment == ()
    assert placed.at(2).forward == 1.5
    assert costs.placed([(s % 4, s // 4) for s in range(8)]).at(3, 1).forward == 1.5


def test_placing_keeps_the_stages_comm_and_update_costs():
    """Only computes and copies come from a segment: comm, reduce and step stay the stage's,
    a per-stage override included."""
    costs = CostModel(
        comm=0.5,
        step=0.25,
        per_stage={1: CostModel(comm=0.75)},
        per_segment=[CostModel(forward=2.0), CostModel(forward=3.0, offload=1.0)],
    )
    placed = costs.placed([(0, 0), (1, 0)])
    assert (placed.at(0).forward, placed.at(0).comm, placed.at(0).step) == (2.0, 0.5, 0.25)
    assert (placed.at(1).forward, placed.at(1).offload, placed.at(1).comm) == (3.0, 1.0, 0.75)


@pytest.mark.parametrize("bad", [[1.0, 2.0], "fast", CostModel(), {0: CostModel()}])
def test_per_segment_must_be_cost_models(bad):
    with pytest.raises(ScheduleConfigError, match="per_segment"):
        CostModel(per_segment=bad)


# The model of a GPT cut in four: segment 0 holds the embedding, segment 3 the LM head and loss.
SEGMENTS = (
    CostModel(forward=1.25, backward=2.5),
    CostModel(forward=1.0, backward=2.0),
    CostModel(forward=1.5, backward=3.0),
    CostModel(forward=2.5, backward=5.0),
)


def _measured(tmp_path, name: str, v: int) -> CostModel:
    """The costs `from_trace` reads off a simulated run of `name` at p = 2 under `SEGMENTS`."""
    program = schedcc.compile(get_schedule(name)(2, 4, v))
    timeline = schedcc.simulate(program, CostModel(per_segment=SEGMENTS))
    return CostModel.from_trace(timeline.to_chrome_trace(tmp_path / f"{name}.json"))


def test_a_trace_reads_back_each_segments_costs_through_its_cut(tmp_path):
    """A looped run and a V run of the same cut read back the same four segments' costs,
    whatever stage ran them, and a DualPipe run its replica's two, its copies pooled."""
    for name in ("interleaved-1f1b", "zb-v"):
        measured = _measured(tmp_path, name, 2)
        assert [c.forward for c in measured.per_segment] == [1.25, 1.0, 1.5, 2.5]
    assert [c.backward for c in _measured(tmp_path, "interleaved-1f1b", 2).per_segment] == [
        2.5, 2.0, 3.0, 5.0,
    ]
    program = schedcc.compile(get_schedule("dualpipe")(2, 4, 2))
    halves = CostModel(per_segment=[SEGMENTS[0], SEGMENTS[3]])
    trace = schedcc.simulate(program, halves).to_chrome_trace(tmp_path / "dual.json")
    assert [c.forward for c in CostModel.from_trace(trace).per_segment] == [1.25, 2.5]


def test_a_v_order_is_priced_by_its_segments_from_a_looped_trace(tmp_path):
    """From an interleaved run's trace, `tune` times a V order (the embedding and the head on
    stage 0) and 1F1B at the cut in 2 (segments merged) as under the true segment costs; the
    stage averages in tune's units would not (checked, so the test cannot pass by chance)."""
    measured = _measured(tmp_path, "interleaved-1f1b", 2)
    # the true segments' costs; comm as measured (a trace's comm includes waits)
    truth = attrs.evolve(measured, per_segment=[_split(c) for c in SEGMENTS])
    result = schedcc.tune(["zb-v", "1f1b"], num_stages=2, num_microbatches=4, costs=measured)
    ranked = {(c.schedule, c.num_chunks): c.makespan for c in result.ranked}
    for name, v in (("zb-v", 2), ("1f1b", 1)):
        program = schedcc.compile(get_schedule(name)(2, 4, v))
        exact = schedcc.simulate(program, truth).makespan
        assert ranked[(name, v)] == pytest.approx(exact)
        averaged = attrs.evolve(measured, per_segment=())
        stage_units = schedcc.simulate(program, _per_chunk(averaged, v)).makespan
        assert stage_units != pytest.approx(exact)


def test_a_search_from_a_looped_trace_finds_v_orders_as_they_simulate(tmp_path):
    """`search` over V orders from an interleaved trace reports the makespan its order has
    under the true segment costs, and its bound is below that."""
    measured = _measured(tmp_path, "interleaved-1f1b", 2)
    truth = attrs.evolve(measured, per_segment=[_split(c) for c in SEGMENTS])
    result = schedcc.search(
        2, 4, costs=measured, num_chunks=2, placement="v", split_backward=False, time_limit=2
    )
    exact = schedcc.simulate(schedcc.compile(result.schedule), truth).makespan
    assert result.makespan == pytest.approx(exact)
    assert result.bound <= exact + 1e-9


def test_a_malformed_segment_table_in_a_trace_is_a_config_error(tmp_path):
    timeline = schedcc.simulate(schedcc.compile(get_schedule("1f1b")(2, 2)))
    path = timeline.to_chrome_trace(tmp_path / "t.json")
    data = json.loads(path.read_text())
    for table in ([[0], [0]], [[0, 1]], "01", [[0], [1.0]]):
        data["otherData"]["cut"]["segments"] = table
        path.write_text(json.dumps(data))
        with pytest.raises(ScheduleConfigError, match="segments"):
            CostModel.from_trace(path)
    del data["otherData"]["cut"]["segments"]  # a trace without one: per-stage costs only
    path.write_text(json.dumps(data))
    assert CostModel.from_trace(path).per_segment == ()


def _split(model: CostModel) -> CostModel:
    """`model` with I = W = B / 2, as a trace of whole backwards is read both ways."""
    half = model.backward / 2
    return attrs.evolve(model, backward_input=half, backward_weight=half)


def test_a_measured_overlapped_pair_is_read_as_its_backward(tmp_path):
    """A run's trace times a pair `F3 +B1` as a marker and the whole pair ([Note: a measured
    pair]): its forward is no forward sample, and the pair less the stage's unpaired forward of
    that chunk is a backward sample; a backward form the pairs alone show is dropped, and a
    simulated trace's `+B` (the rest of the pair) is read as a backward as it is."""

    def event(name, ts, dur, tid=0):
        return {"name": name, "ph": "X", "pid": 0, "tid": tid, "ts": ts, "dur": dur}

    events = [
        event("F0", 0, 2000), event("F1", 2000, 2200),  # unpaired: median 2.1 ms
        event("SA0", 4200, 50),  # comm between a forward and a pair's backward is no pair
        event("F2", 4300, 10), event("+B0", 4310, 3100),  # B0 = 3.1 - 2.1 = 1.0
        event("F3", 7500, 10), event("+B1", 7510, 3300),  # B1 = 1.2
        event("B2", 10900, 1100), event("B3", 12000, 1300),  # B: 1.0, 1.2, 1.1, 1.3
        event("F0", 0, 3000, tid=2), event("+B0", 3000, 4000, tid=2),  # stage 2: a pair only
    ]  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"traceEvents": events, "otherData": {"measured": True}}))
    measured = CostModel.from_trace(path)
    assert measured.at(0).forward == pytest.approx(2.1)
    assert measured.at(0).backward == pytest.approx(1.15)
    assert sorted(measured.per_stage) == [0]  # no forward of stage 2 to take off its pair
    path.write_text(json.dumps({"traceEvents": events[:9]}))  # simulated: each as priced
    simulated = CostModel.from_trace(path)
    assert simulated.at(0).forward == pytest.approx(1.005)  # median of 2.0, 2.2, 0.01, 0.01
    assert simulated.at(0).backward == pytest.approx(2.2)  # 3.1, 3.3, 1.1, 1.3
