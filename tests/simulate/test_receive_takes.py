"""A receive's take: what the receiving stage spends taking a message that has come, charged to
the compute that first needs it, in both timelines, and how a measured trace gives it apart from
the message's comm ([Note: a receive's take] in `schedcc/costs.py`)."""

from __future__ import annotations

import json

import attrs
import pytest

import schedcc
from schedcc import CostModel, ScheduleConfigError
from schedcc.costs import takes
from schedcc.draw.chrome import chrome_trace
from schedcc.ir import OptimizerStep, RecvGrad, SendActivation

_COSTS = CostModel(forward=1.0, backward=2.0, comm=0.25, receive=0.5)


def test_the_computes_that_need_a_message_take_it():
    """1F1B at p = 2, m = 1: stage 1's forward and stage 0's backward each take one message.
    Eagerly F0, its flight, its take, F0 and B0 on stage 1, the gradient's flight and take, B0:
    1 + 0.25 + 0.5 + 1 + 2 + 0.25 + 0.5 + 2; in the rendezvous model both takes lie on the
    only path as well."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 1))
    free = attrs.evolve(_COSTS, receive=0.0)
    assert schedcc.simulate(program, _COSTS, eager=True).makespan == pytest.approx(7.5)
    assert schedcc.simulate(program, free, eager=True).makespan == pytest.approx(6.5)
    rendezvous = schedcc.simulate(program, _COSTS).makespan
    assert rendezvous == pytest.approx(schedcc.simulate(program, free).makespan + 1.0)


@pytest.mark.parametrize(
    ("name", "recompute", "want"),
    [
        ("1f1b", False, {(1, "F0"), (1, "F1"), (0, "B0"), (0, "B1")}),
        ("1f1b", True, {(1, "F0"), (1, "F1"), (0, "B0"), (0, "B1")}),  # not the R
        ("zb-h1", False, {(1, "F0"), (1, "F1"), (0, "I0"), (0, "I1")}),  # not the W
    ],
)
def test_only_the_first_compute_to_need_a_message_takes_it(name, recompute, want):
    """A recomputation reads the input its forward took, a weight gradient the gradient its
    input gradient took: neither takes a message again."""
    program = schedcc.compile(schedcc.get_schedule(name)(2, 2), recompute=recompute)
    got = takes(CostModel(receive=1.0), program.stages, program.tensors)
    assert {(s, str(program.stages[s][pos])) for s, pos in got} == want
    assert set(got.values()) == {1.0}


def test_a_stage_takes_at_its_own_price_and_not_from_its_own_chunks():
    """Interleaved at p = 2, v = 2: every forward but stage 0's first chunk's and every backward
    but stage 1's last chunk's takes a message, each at its receiving stage's `receive`."""
    program = schedcc.compile(schedcc.get_schedule("interleaved-1f1b")(2, 2, num_chunks=2))
    costs = CostModel(per_stage={0: CostModel(receive=0.25), 1: CostModel(receive=0.5)})
    got = takes(costs, program.stages, program.tensors)
    taking = {(s, str(program.stages[s][pos])): cost for (s, pos), cost in got.items()}
    assert taking == {
        **{(0, f"F{i}.1"): 0.25 for i in range(2)},
        **{(0, f"B{i}"): 0.25 for i in range(2)},
        **{(1, f"F{i}"): 0.5 for i in range(2)},
        **{(1, f"F{i}.1"): 0.5 for i in range(2)},
        **{(1, f"B{i}"): 0.5 for i in range(2)},
        **{(0, f"B{i}.1"): 0.25 for i in range(2)},
    }
    assert takes(CostModel(), program.stages, program.tensors) == {}


def _event(name: str, stage: int, ts: float, dur: float, take: float | None = None) -> dict:
    args = {} if take is None else {"take_us": take}
    return {"name": name, "ph": "X", "pid": 0, "tid": stage, "ts": ts, "dur": dur, "args": args}


_EVENTS = [
    _event("F0", 0, 0, 1000),
    _event("RA0", 1, 0, 300, 100),
    _event("RA1", 1, 1000, 150, 50),
    _event("SG0", 1, 2000, 400),  # one comm group: the send and the receive share its span
    _event("RA2", 1, 2000, 400, 100),
    _event("F0", 1, 2400, 1000),
]


def test_a_trace_reads_each_receive_s_take_apart_from_its_comm():
    """Per stage, `receive` is the median take (0.1, 0.05, 0.1 ms) and each comm op's sample its
    duration less its group's takes (0.2, 0.1, 0.3 and 0.3 ms); without takes, the durations as
    they are and no `receive`."""
    read = CostModel.from_trace(_EVENTS)
    assert read.at(1).receive == pytest.approx(0.1)
    assert read.at(1).comm == pytest.approx(0.25)
    assert read.at(0).receive == 0.0
    bare = CostModel.from_trace([{**e, "args": {}} for e in _EVENTS])
    assert bare.at(1).receive == 0.0
    assert bare.at(1).comm == pytest.approx(0.35)
    assert CostModel.from_trace(_EVENTS[:1], receive=0.2).at(0).receive == 0.2


@pytest.mark.parametrize("bad", [-1.0, "slow", False])
def test_a_malformed_take_is_a_config_error(bad):
    with pytest.raises(ScheduleConfigError, match="take_us"):
        CostModel.from_trace([_event("RA0", 1, 0, 100, bad)])


def test_a_trace_writes_a_receive_s_take_where_given():
    """A comm op's fifth element is its take, written as `take_us` (a compute's is its own
    time, `segment_us`); None writes nothing."""
    trace = chrome_trace(
        [
            (0, RecvGrad(0), 0.0, 0.5, 0.25),
            (0, SendActivation(0), 0.0, 0.5, None),
            (0, OptimizerStep(), 2.0, 3.0, None),
        ],
        unit_us=1000,
    )
    args = {e["name"]: e["args"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert args["RG0"] == {"kind": "RecvGrad", "microbatch": 0, "chunk": 0, "take_us": 250.0}
    assert "take_us" not in args["SA0"]
    assert "segment_us" not in args["RG0"]
    json.dumps(trace)


def test_a_negative_receive_is_refused():
    with pytest.raises(ScheduleConfigError):
        CostModel(receive=-0.1)


def test_a_stage_s_first_take_of_a_run_warms_up():
    """`warmup_receive` goes to the first compute on each stage that takes a message, whatever
    its chunk, once a run: 1F1B at p = 2, stage 1's F0 and stage 0's B0; interleaved at v = 2,
    stage 0's first chunk-1 forward. At m = 1 both lie on the one path: 7.5 + 2 * 0.75."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    got = takes(CostModel(receive=0.5, warmup_receive=0.75), program.stages, program.tensors)
    taking = {(s, str(program.stages[s][pos])): cost for (s, pos), cost in got.items()}
    assert taking == {(1, "F0"): 1.25, (1, "F1"): 0.5, (0, "B0"): 1.25, (0, "B1"): 0.5}
    alone = takes(CostModel(warmup_receive=0.75), program.stages, program.tensors)
    assert {(s, str(program.stages[s][pos])) for s, pos in alone} == {(1, "F0"), (0, "B0")}
    interleaved = schedcc.compile(schedcc.get_schedule("interleaved-1f1b")(2, 2, num_chunks=2))
    first = takes(CostModel(warmup_receive=0.75), interleaved.stages, interleaved.tensors)
    assert {(s, str(interleaved.stages[s][pos])) for s, pos in first} == {(0, "F0.1"), (1, "F0")}
    one = schedcc.compile(schedcc.get_schedule("1f1b")(2, 1))
    warm = attrs.evolve(_COSTS, warmup_receive=0.75)
    assert schedcc.simulate(one, warm, eager=True).makespan == pytest.approx(9.0)
    assert schedcc.simulate(one, warm).makespan == pytest.approx(
        schedcc.simulate(one, _COSTS).makespan + 1.5
    )


def test_a_trace_reads_each_stage_s_first_take_of_a_run():
    """Two runs on stage 1, each split at its step: first takes 0.4 and 0.3 ms, the rest 0.05,
    0.06 and 0.07: `receive` the median take (0.065), `warmup_receive` the median first take's
    excess over it (0.285); a stage without takes has none."""
    events = []
    for run, (first, *rest) in enumerate([(400, 50, 60), (300, 50, 70)]):
        base = run * 10_000
        events += [_event(f"RA{i}", 1, base + 1000 * i, 500, take)
                   for i, take in enumerate((first, *rest))]  # fmt: skip
        events += [_event("F0", 0, base, 1000), _event("Step", 1, base + 5000, 100)]
        events += [_event("Step", 0, base + 5000, 100)]
    read = CostModel.from_trace(events)
    assert read.at(1).receive == pytest.approx(0.065)
    assert read.at(1).warmup_receive == pytest.approx(0.285)
    assert read.at(0).warmup_receive == 0.0
    assert CostModel.from_trace(events, warmup_receive=0.1).at(1).warmup_receive == 0.1


def test_a_negative_first_take_is_refused():
    with pytest.raises(ScheduleConfigError):
        CostModel(warmup_receive=-0.1)
