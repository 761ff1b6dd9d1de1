"""A compute's per-call time: read off traces of one model at two or more cuts, the part of each
compute that does not shrink with its chunk ([Note: a compute's per-call time] in
`schedcc/costs.py`)."""

from __future__ import annotations

import json

import pytest

import schedcc
from schedcc import CostModel, ScheduleConfigError
from schedcc.tune import priced


def _trace(calls: int, forward: float, backward: float, *, own: float | None = None) -> dict:
    """A trace of two stages, each running its share as `calls` chunks: every chunk's forward
    `forward / calls + 0.3` ms and backward `backward / calls + 0.5` ms (0.3 and 0.5 per call
    whatever the chunk), stage 1 half as dear again; `own`: each compute's own time is its
    duration less `own` ms."""
    events = []
    for stage in range(2):
        scale = 1.0 + 0.5 * stage
        for chunk in range(calls):
            name = "" if chunk == 0 else f".{chunk}"
            for code, share, per_call in (("F", forward, 0.3), ("B", backward, 0.5)):
                for microbatch in range(3):
                    dur = (share * scale / calls + per_call) * 1000
                    args = {} if own is None else {"segment_us": dur - own * 1000}
                    events.append(
                        {"name": f"{code}{microbatch}{name}", "ph": "X", "pid": 0,
                         "tid": stage, "ts": 0, "dur": dur, "args": args}
                    )  # fmt: skip
    return {"traceEvents": events, "otherData": {}}


def test_two_cuts_read_each_compute_s_per_call_part():
    """From v = 1 and v = 2 the per-call part per stage: priced at v = 2 each chunk is as its
    trace measured, at v = 4 its quarter plus the part; read either way round."""
    one, two = _trace(1, 2.0, 4.0), _trace(2, 2.0, 4.0)
    for trace, other in ((one, two), (two, one)):
        read = CostModel.from_trace(trace, other_cuts=[other])
        assert read.at(0).fixed_forward == pytest.approx(0.3)
        assert read.at(1).fixed_backward == pytest.approx(0.5)
        assert read.at(1).forward == pytest.approx(3.0 + 0.3)  # the stage at v = 1
        assert read.fixed_forward == pytest.approx(0.3)  # over the stages
        for v, chunk in ((2, 1.0), (4, 0.5)):
            schedule = schedcc.get_schedule("interleaved-1f1b")(2, 4, num_chunks=v)
            model = priced(read, schedule)
            assert model.at(0, 1).forward == pytest.approx(chunk + 0.3)
            assert model.at(1, 0).backward == pytest.approx(3.0 * chunk + 0.5)
    alone = priced(CostModel.from_trace(one), schedcc.get_schedule("zb-v")(2, 4))
    assert alone.at(0, 0).forward == pytest.approx((2.0 + 0.3) / 2)  # one cut divides it all


def test_the_simulated_step_at_another_cut_is_the_one_measured_costs_give():
    """Interleaved 1F1B at v = 2 priced from a v = 1 trace and a v = 2 one simulates as with
    the v = 2 run's chunk costs written out."""
    read = CostModel.from_trace(_trace(1, 2.0, 4.0), other_cuts=[_trace(2, 2.0, 4.0)])
    schedule = schedcc.get_schedule("interleaved-1f1b")(2, 8, num_chunks=2)
    program = schedcc.compile(schedule)
    by_hand = CostModel(
        forward=1.3, backward=2.5, per_stage={1: CostModel(forward=1.8, backward=3.5)}
    )
    alone = CostModel.from_trace(_trace(1, 2.0, 4.0))
    for eager in (False, True):
        want = schedcc.simulate(program, by_hand, eager=eager).makespan
        assert schedcc.simulate(program, priced(read, schedule), eager=eager).makespan == (
            pytest.approx(want)
        )
        assert schedcc.simulate(program, priced(alone, schedule), eager=eager).makespan < want


def test_three_cuts_fit_a_line_by_least_squares(tmp_path):
    """Sums at k = 1, 2, 4 of 2.2, 2.8, 3.7 (not on one line): the slope of their least-squares
    line, 2.3 / (42 / 9) (its covariance over the variance of the counts); traces as files."""
    paths = []
    for k, total in ((1, 2.2), (2, 2.8), (4, 3.7)):
        events = [
            {"name": f"F0{'' if c == 0 else f'.{c}'}", "ph": "X", "pid": 0, "tid": 0, "ts": 0,
             "dur": total / k * 1000}
            for c in range(k)
        ]  # fmt: skip
        paths.append(tmp_path / f"v{k}.json")
        paths[-1].write_text(json.dumps(events))
    read = CostModel.from_trace(paths[0], other_cuts=paths[1:])
    assert read.at(0).fixed_forward == pytest.approx(2.3 / (42 / 9))


def test_the_part_is_no_less_than_the_runtime_s_nor_more_than_a_compute():
    """Where the trace measured the runtime's part (each compute's own time) above the slope,
    the runtime's part; a slope above a compute's cost, the cost; a part the caller gives
    wins."""
    runtime = CostModel.from_trace(_trace(1, 2.0, 4.0, own=0.6), other_cuts=[_trace(2, 2.0, 4.0)])
    assert runtime.at(0).fixed_forward == pytest.approx(0.6)
    assert runtime.at(0).fixed_backward == pytest.approx(0.6)
    steep = CostModel.from_trace(_trace(1, 0.1, 4.0), other_cuts=[_trace(2, 3.0, 4.0)])
    assert steep.at(0).fixed_forward == pytest.approx(0.1 + 0.3)  # stage 0's forward at v = 1
    given = CostModel.from_trace(
        _trace(1, 2.0, 4.0), other_cuts=[_trace(2, 2.0, 4.0)], fixed_forward=0.1
    )
    assert (given.at(0).fixed_forward, given.at(0).fixed_backward) == pytest.approx((0.1, 0.5))


def test_other_cuts_that_cut_as_the_trace_does_or_other_stages_are_refused():
    with pytest.raises(ScheduleConfigError, match="another v"):
        CostModel.from_trace(_trace(2, 2.0, 4.0), other_cuts=[_trace(2, 2.1, 4.0)])
    one_stage = {"traceEvents": _trace(2, 2.0, 4.0)["traceEvents"][:12]}
    with pytest.raises(ScheduleConfigError, match="stages"):
        CostModel.from_trace(_trace(1, 2.0, 4.0), other_cuts=[one_stage])


def test_other_cuts_of_another_model_or_device_are_refused():
    """Where both traces record what their run trained (as `schedcc run --trace` writes it),
    another model, dtype or device is one typed error naming it; the bytes, which differ by
    cut, are no reason."""
    one, two = _trace(1, 2.0, 4.0), _trace(2, 2.0, 4.0)
    run = {"device": "cpu", "memory": {"model": "tiny-gpt", "dtype": "float32", "activations": [1]}}
    one["otherData"] = run
    for key, value in (("model", "mlp"), ("dtype", "float64")):
        two["otherData"] = {**run, "memory": {**run["memory"], key: value, "activations": [2]}}
        with pytest.raises(ScheduleConfigError, match=f"{key} = '{value}'"):
            CostModel.from_trace(one, other_cuts=[two])
    two["otherData"] = {**run, "device": "cuda"}
    with pytest.raises(ScheduleConfigError, match="device = 'cuda'"):
        CostModel.from_trace(one, other_cuts=[two])
    two["otherData"] = {**run, "memory": {**run["memory"], "activations": [2, 2]}}
    assert CostModel.from_trace(one, other_cuts=[two]).at(0).fixed_forward == pytest.approx(0.3)


def test_each_cut_a_trace_measured_is_priced_from_that_trace_s_segments():
    """With their cut records, a v = 2 trace and a v = 1 one of the same model: orders at v = 1
    read each segment as the v = 1 run measured it, not the v = 2 run's segments merged;
    orders at v = 2 the v = 2 run's, either way round."""

    def cut(v: int) -> dict:
        segments = [[0], [1]] if v == 1 else [[0, 2], [1, 3]]
        return {"num_stages": 2, "num_chunks": v, "num_replicas": 1, "segments": segments}

    one, two = _trace(1, 2.0, 4.0), _trace(2, 2.0, 4.0)
    one["otherData"], two["otherData"] = {"cut": cut(1)}, {"cut": cut(2)}
    for event in one["traceEvents"]:  # stage 1's v = 1 forward: not the v = 2 chunks merged
        if event["tid"] == 1 and event["name"].startswith("F"):
            event["dur"] = 5000.0
    looped = schedcc.get_schedule("1f1b")(2, 4)
    interleaved = schedcc.get_schedule("interleaved-1f1b")(2, 4, num_chunks=2)
    for trace, other in ((two, one), (one, two)):
        read = CostModel.from_trace(trace, other_cuts=[other])
        assert [len(t) for t in (read.per_segment, *read.other_segments)] in ([4, 2], [2, 4])
        assert priced(read, looped).at(1).forward == pytest.approx(5.0)
        assert priced(read, interleaved).at(1, 0).forward == pytest.approx(1.5 + 0.3)
    unrecorded = _trace(1, 2.0, 4.0)  # no cut record: v = 1 merges segments 2 and 3 of v = 2
    merged = priced(CostModel.from_trace(two, other_cuts=[unrecorded]), looped)
    assert merged.at(1).forward == pytest.approx(1.3 + 1.8 - 0.3)


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (5, "other_segments must be a sequence of per_segment tables"),
        ([CostModel()], r"other_segments\[0\] must be a sequence of CostModels"),
        ([[CostModel(), 1]], r"other_segments\[0\]\[1\] must be a CostModel"),
    ],
)
def test_a_malformed_table_of_another_cut_is_refused(bad, says):
    with pytest.raises(ScheduleConfigError, match=says):
        CostModel(other_segments=bad)
