"""The simulator: textbook makespans and bubbles, memory, weight versions, costs and traces."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import schedcc
from schedcc import CostModel, ScheduleConfigError, ScheduleError, simulate
from schedcc.ir import (
    RECEIVES,
    Backward,
    BackwardInput,
    Comm,
    Compute,
    Forward,
    OverlappedBackward,
    RecvActivation,
)
from schedcc.semantics import Tensors
from schedcc.testing import schedules

shapes = st.tuples(st.integers(1, 8), st.integers(1, 32))


def timeline_of(name, p, m, v=1, batches=1, costs=None):
    program = schedcc.compile(schedcc.get_schedule(name)(p, m, v, batches))
    return simulate(program, costs)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@given(shape=shapes)
def test_flush_schedules_have_the_textbook_makespan_and_bubble(name, shape):
    """GPipe and 1F1B take 3(m + p - 1) with bubble (p - 1) / (m + p - 1) at F=1, B=2."""
    p, m = shape
    timeline = timeline_of(name, p, m)
    assert timeline.makespan == 3 * (m + p - 1)
    assert math.isclose(timeline.bubble_fraction, (p - 1) / (m + p - 1), abs_tol=1e-12)


@given(shape=shapes)
def test_one_f_one_b_bounds_activations_where_gpipe_holds_every_microbatch(shape):
    """1F1B holds min(p - s, m) activations on stage s; GPipe holds m on every stage."""
    p, m = shape
    assert timeline_of("1f1b", p, m).peak_activations == tuple(min(p - s, m) for s in range(p))
    assert timeline_of("gpipe", p, m).peak_activations == (m,) * p


@given(shape=shapes, batches=st.integers(1, 3))
def test_flush_schedules_hold_one_weight_version(shape, batches):
    """With a flush per batch, the old weights die at the step: one version at a time."""
    p, m = shape
    assert timeline_of("1f1b", p, m, batches=batches).peak_versions == (1,) * p


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@given(shape=shapes)
def test_critical_path_runs_from_zero_to_the_makespan_without_slack(name, shape):
    """The computes on the critical path add up to the makespan when comm is free."""
    p, m = shape
    timeline = timeline_of(name, p, m)
    path = timeline.critical_path
    assert path[0].start == 0
    assert path[-1].end == timeline.makespan
    compute = sum(e.end - e.start for e in path if isinstance(e.instruction, Compute))
    assert compute == timeline.makespan


def test_busy_and_idle_add_up_to_the_makespan_on_every_stage():
    """Busy plus idle is the makespan, and busy is the stage's compute work (3m)."""
    timeline = timeline_of("1f1b", 4, 8)
    assert timeline.busy == (24.0,) * 4
    assert all(b + i == timeline.makespan for b, i in zip(timeline.busy, timeline.idle))


def test_events_cover_every_instruction_in_program_order():
    """One event per instruction, in program order; steps on a stage never overlap.

    The ops of one comm group share the group's interval (posted..done).
    """
    timeline = timeline_of("1f1b", 3, 5, costs=CostModel(comm=0.25))
    program = timeline.program
    assert [(e.stage, e.instruction) for e in timeline.events] == [
        (s, op) for s, ops in enumerate(program.stages) for op in ops
    ]
    for s in range(program.num_stages):
        row = [e for e in timeline.events if e.stage == s]
        for a, b in itertools.pairwise(row):
            assert a.end <= b.start + 1e-12 or (a.start, a.end) == (b.start, b.end)


def test_a_timeline_built_from_measured_events_reads_the_same():
    """Timeline(program, events) from plain tuples gives the simulated makespan and bubble."""
    simulated = timeline_of("1f1b", 3, 4, costs=CostModel(comm=0.5))
    measured = schedcc.Timeline(simulated.program, [tuple(e) for e in simulated.events])
    assert measured.makespan == simulated.makespan
    assert measured.busy == simulated.busy
    assert measured.bubble_fraction == simulated.bubble_fraction
    assert measured.critical_path == ()


def test_interleaving_shrinks_the_bubble_as_chunks_grow():
    """Interleaved 1F1B's bubble falls as v grows (p = 4, m = 8, v = 1, 2, 4)."""
    bubbles = [timeline_of("interleaved-1f1b", 4, 8, v).bubble_fraction for v in (1, 2, 4)]
    assert bubbles[0] > bubbles[1] > bubbles[2]


@pytest.mark.parametrize("batches", [2, 3])
def test_two_bw_has_no_flush_between_batches_and_two_versions(batches):
    """PipeDream-2BW over B batches takes 3(Bm + p - 1) and holds two weight versions."""
    p, m = 4, 8
    timeline = timeline_of("2bw", p, m, batches=batches)
    assert timeline.makespan == 3 * (batches * m + p - 1)
    assert max(timeline.peak_versions) == 2
    flush = timeline_of("1f1b", p, m, batches=batches)
    assert flush.makespan == batches * 3 * (m + p - 1)


def test_costs_scale_the_makespan_and_comm_adds_to_it():
    """Doubling every cost doubles the makespan; a comm cost lengthens it."""
    base = timeline_of("1f1b", 4, 8).makespan
    double = CostModel(forward=2.0, backward=4.0)
    assert timeline_of("1f1b", 4, 8, costs=double).makespan == 2 * base
    assert timeline_of("1f1b", 4, 8, costs=CostModel(comm=0.5)).makespan > base


def test_a_slow_stage_override_applies_to_that_stage_only():
    """per_stage costs slow one stage; per_chunk costs apply to that chunk's computes."""
    costs = CostModel(per_stage={3: CostModel(forward=2.0, backward=4.0)})
    timeline = timeline_of("1f1b", 4, 8, costs=costs)
    assert timeline.busy == (24.0, 24.0, 24.0, 48.0)
    chunked = CostModel(per_chunk={1: CostModel(forward=3.0)})
    assert chunked.at(0, 1).forward == 3.0
    assert chunked.at(0, 0).forward == 1.0
    nested = CostModel(per_stage={2: CostModel(per_chunk={1: CostModel(forward=5.0)})})
    assert nested.at(2, 1).forward == 5.0
    assert nested.at(2, 0).forward == 1.0


@pytest.mark.parametrize(
    "bad",
    [
        {"forward": -1.0},
        {"backward": math.inf},
        {"comm": "fast"},
        {"per_stage": {-1: CostModel()}},
        {"per_chunk": {0: 1}},
    ],
)
def test_a_bad_cost_model_is_a_config_error(bad):
    """A negative or non-numeric cost, or a malformed override, raises ScheduleConfigError."""
    with pytest.raises(ScheduleConfigError):
        CostModel(**bad)


def test_costs_read_back_from_a_trace_equal_the_costs_simulated(tmp_path):
    """from_trace of a simulated trace gives back each stage's compute costs (medians)."""
    costs = CostModel(forward=1.5, backward=2.5, per_stage={1: CostModel(forward=3.0)})
    path = timeline_of("1f1b", 3, 6, costs=costs).to_chrome_trace(tmp_path / "t.json")
    measured = CostModel.from_trace(path)
    assert measured.at(0).forward == 1.5
    assert measured.at(0).backward == 2.5
    assert measured.at(1).forward == 3.0
    assert measured.at(2).forward == 1.5
    parsed = json.loads(path.read_text())  # the trace's object, as a file's: the same costs
    assert CostModel.from_trace(parsed) == measured


def test_a_trace_at_two_chunks_reads_back_a_stages_share(tmp_path):
    """A stage's costs are its share of the model at v = 1 ([Note: a trace's cut]): a trace of
    a run at v = 2 gives the sum of the stage's two chunks' medians, and over the model replicas
    when the trace's cut has two (DualPipe's chunks each run a replica's whole share)."""
    chunks = {0: CostModel(forward=1.0, backward=2.0), 1: CostModel(forward=2.0, backward=3.0)}
    costs = CostModel(per_chunk=chunks)
    for name, share in (("interleaved-1f1b", 1), ("dualpipe", 2)):
        program = schedcc.compile(schedcc.get_schedule(name)(2, 4, 2))
        path = schedcc.simulate(program, costs).to_chrome_trace(tmp_path / f"{name}.json")
        measured = CostModel.from_trace(path, num_stages=2)
        assert (measured.at(0).forward, measured.at(1).forward) == (3.0 / share, 3.0 / share)
    assert CostModel.from_trace(tmp_path / "interleaved-1f1b.json").at(1).backward == 5.0


def test_a_trace_with_copy_lanes_reads_them_as_their_stages(tmp_path):
    """An offloading run's trace draws each stage's copies on a track of their own: they are
    that stage's offload and reload costs, not another stage's."""
    costs = CostModel(offload=0.5, reload=0.25, per_stage={1: CostModel(offload=0.75)})
    program = schedcc.compile(schedcc.get_schedule("1f1b-offload")(3, 8))  # stages 0, 1 copy
    path = schedcc.simulate(program, costs).to_chrome_trace(tmp_path / "t.json")
    measured = CostModel.from_trace(path, num_stages=3)
    assert sorted(measured.per_stage) == [0, 1, 2]
    assert (measured.at(0).offload, measured.at(0).reload) == (0.5, 0.25)
    assert measured.at(1).offload == 0.75


def test_a_trace_of_another_depth_is_refused_when_the_depth_is_given(tmp_path):
    """`num_stages=` checks the trace measured exactly those stages: a stage's costs depend on
    how the model was cut, so a 3-stage trace read for 2 or 4 stages is a config error."""
    path = timeline_of("1f1b", 3, 6).to_chrome_trace(tmp_path / "t.json")
    assert sorted(CostModel.from_trace(path, num_stages=3).per_stage) == [0, 1, 2]
    for wrong in (2, 4):
        with pytest.raises(ScheduleConfigError, match=rf"stages \[0, 1, 2\], not the {wrong}"):
            CostModel.from_trace(path, num_stages=wrong)


def test_from_trace_reads_a_process_per_stage_trace_in_seconds():
    """Events whose pid is the stage and dur in microseconds give costs in the unit asked for."""
    events = [
        {"name": "F0", "ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 2e6},
        {"name": "B0", "ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 4e6},
        {"name": "F0", "ph": "X", "pid": 1, "tid": 0, "ts": 0, "dur": 3e6},
        {"name": "step", "ph": "X", "pid": 1, "tid": 0, "ts": 0, "dur": 1},
    ]
    costs = CostModel.from_trace(events, unit_us=1e6, comm=0.5)
    assert (costs.at(0).forward, costs.at(0).backward, costs.at(1).forward) == (2.0, 4.0, 3.0)
    assert costs.at(1).comm == 0.5
    with pytest.raises(ScheduleConfigError):
        CostModel.from_trace([{"name": "nothing", "ph": "X", "dur": 1}])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{bad", "is not JSON"),
        ('{"traceEvents": 5}', "list of events"),
        ('[1, {"name": "F0", "ph": "X", "dur": "x"}]', "must be numbers"),
        (
            '{"traceEvents": [{"name": "F0", "ph": "X", "dur": 1}], '
            '"otherData": {"cut": {"num_replicas": 0}}}',
            "num_replicas, a positive integer",
        ),
    ],
)
def test_from_trace_rejects_a_malformed_trace_file_with_a_config_error(tmp_path, text, message):
    """A file that is not JSON, not a trace, or has a non-numeric duration is a config error."""
    path = tmp_path / "trace.json"
    path.write_text(text)
    with pytest.raises(ScheduleConfigError, match=message):
        CostModel.from_trace(path)


def test_simulating_an_invalid_program_raises_the_validators_error():
    """A program with a receive removed raises a ScheduleError, not a wrong timeline."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    stage1 = tuple(op for op in program.stages[1] if op != RecvActivation(1))
    broken = program.evolve(stages=(program.stages[0], stage1))
    with pytest.raises(ScheduleError):
        simulate(broken)


def test_simulate_rejects_what_is_not_a_program():
    """Passing a schedule instead of its compiled program is a config error that says so."""
    with pytest.raises(ScheduleConfigError, match="compiled Program"):
        simulate(schedcc.get_schedule("1f1b")(2, 2))


# -- eager: sends that never wait ([Note: eager simulation]) ------------------------------------

BUILT_INS = sorted({schedcc.get_schedule(name) for name in schedcc.available_schedules()}, key=str)
costs_ = st.builds(
    CostModel,
    forward=st.sampled_from([0.5, 1.0, 2.0]),
    backward=st.sampled_from([1.0, 2.0, 3.0]),
    backward_input=st.sampled_from([0.5, 1.0, 1.5]),
    backward_weight=st.sampled_from([0.5, 1.0, 1.5]),
    comm=st.sampled_from([0.0, 0.25, 1.0]),
    step=st.sampled_from([0.0, 1.0]),
)


@pytest.mark.parametrize("cls", BUILT_INS, ids=lambda cls: cls.name)
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data(), costs=costs_)
def test_eager_timing_is_the_earliest_the_data_allows(cls, data, costs):
    """Every compute starts exactly when its stage is free and its inputs from other stages have
    arrived (the sender's compute end plus the receive's comm cost); no compute starts later
    than in the rendezvous model, so the makespan is at most its."""
    schedule = data.draw(schedules(cls, max_stages=5, max_microbatches=10))
    program = schedcc.compile(schedule)
    eager = simulate(program, costs, eager=True)
    rendezvous = simulate(program, costs)
    assert [(e.stage, e.instruction) for e in eager.events] == [
        (s, op) for s, ops in enumerate(program.stages) for op in ops
    ]
    ends = {}  # tensor key -> when the compute producing it ended (an overlapped pair's end)
    tensors = Tensors.of(schedule)
    events = eager.events
    for n, e in enumerate(events):
        key = tensors.makes(e.stage, e.instruction)
        if key is not None:
            paired = n + 1 < len(events) and type(events[n + 1].instruction) is OverlappedBackward
            ends[key] = events[n + 1].end if paired else e.end
    arrivals = {}  # (stage, consumer classes, microbatch, chunk) -> when its message arrived
    for e in eager.events:
        op = e.instruction
        if isinstance(op, RECEIVES):
            route = tensors.route(e.stage, op)
            assert e.start == ends[route.tensor]  # the flight starts at the producer's end
            assert e.end == pytest.approx(e.start + costs.cost(e.stage, op))
            consumer = (
                (Forward,)
                if type(op) is RecvActivation
                else (Backward, BackwardInput, OverlappedBackward)
            )
            arrivals[e.stage, consumer, op.microbatch, op.chunk] = e.end
    for s in range(program.num_stages):
        free = 0.0
        own = [e for e in eager.events if e.stage == s and not isinstance(e.instruction, Comm)]
        for n, e in enumerate(own):
            ops = [e.instruction]  # a forward overlapped with the next waits for both inputs
            if n + 1 < len(own) and type(own[n + 1].instruction) is OverlappedBackward:
                ops.append(own[n + 1].instruction)
            if type(e.instruction) is OverlappedBackward:
                ops = []
            waits = [
                t
                for (stage, classes, i, c), t in arrivals.items()
                for op in ops
                if stage == s and type(op) in classes and (i, c) == (op.microbatch, op.chunk)
            ]
            op = e.instruction
            assert e.start == pytest.approx(max([free, *waits]))
            assert e.end == pytest.approx(e.start + costs.cost(s, op))
            free = e.end
    for a, b in zip(eager.events, rendezvous.events):  # both in program order
        if not isinstance(a.instruction, Comm):
            assert a.start <= b.start + 1e-9
    assert eager.makespan <= rendezvous.makespan + 1e-9
    assert eager.busy == pytest.approx(rendezvous.busy)


@pytest.mark.parametrize(("name", "p", "m", "v"), [("1f1b", 4, 8, 1), ("gpipe", 3, 5, 1)])
def test_eager_flush_schedules_keep_the_textbook_makespan(name, p, m, v):
    """Where the rendezvous model already reaches the textbook, eager sends change nothing."""
    program = schedcc.compile(schedcc.get_schedule(name)(p, m, v))
    assert simulate(program, eager=True).makespan == simulate(program).makespan == 3 * (m + p - 1)


def test_eager_comm_is_in_flight_not_on_the_stage():
    """A comm cost delays the consumer (the message is in flight) but takes no stage time."""
    program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 1))
    timeline = simulate(program, CostModel(comm=0.5), eager=True)
    assert timeline.makespan == 1 + 0.5 + 1 + 2 + 0.5 + 2  # F0, flight, F1, B1, flight, B0
    assert timeline.busy == (3.0, 3.0)
    assert timeline.critical_path == ()


def test_simulating_an_invalid_program_eagerly_raises_the_validators_error():
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    stage1 = tuple(op for op in program.stages[1] if op != RecvActivation(1))
    broken = program.evolve(stages=(program.stages[0], stage1))
    with pytest.raises(ScheduleError):
        simulate(broken, eager=True)


def test_a_trace_of_whole_backwards_is_read_split_too_and_the_other_way():
    """A trace with B only gives I = W = B / 2 on each stage; one with I and W only gives
    B = I + W; a kind the caller gives is kept ([Note: a trace's backward both ways])."""
    whole = [
        {"name": "F0", "ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 2e3},
        {"name": "B0", "ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 8e3},
        {"name": "B0", "ph": "X", "pid": 1, "tid": 0, "ts": 0, "dur": 6e3},
    ]
    costs = CostModel.from_trace(whole)
    assert (costs.at(0).backward_input, costs.at(0).backward_weight) == (4.0, 4.0)
    assert (costs.at(1).backward_input, costs.at(1).backward_weight) == (3.0, 3.0)
    assert CostModel.from_trace(whole, backward_weight=1.5).at(0).backward_weight == 1.5
    split = [
        {"name": "I0", "ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 3e3},
        {"name": "W0", "ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 2e3},
        {"name": "F0", "ph": "X", "pid": 1, "tid": 0, "ts": 0, "dur": 1e3},
    ]
    assert CostModel.from_trace(split).at(0).backward == 5.0


def test_a_cpu_runs_trace_prices_overlapped_pairs_as_run_in_order(tmp_path):
    """`"device": "cpu"` in the trace's otherData gives overlap 1 (the CPU backends run a pair's
    halves in order); a GPU run's trace, or one without the key, keeps the default."""
    events = [{"name": "F0", "ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 1e3}]
    default = CostModel().overlap
    for device, overlap in (("cpu", 1.0), ("cuda", default), (None, default)):
        path = tmp_path / f"{device}.json"
        other = {} if device is None else {"otherData": {"device": device}}
        path.write_text(json.dumps({"traceEvents": events, **other}))
        assert CostModel.from_trace(path).overlap == overlap
    path.write_text(json.dumps({"traceEvents": events, "otherData": {"device": "cpu"}}))
    assert CostModel.from_trace(path, overlap=0.25).overlap == 0.25
