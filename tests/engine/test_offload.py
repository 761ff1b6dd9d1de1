"""Offloading: `Offload`/`Reload`, `compile(offload=...)`, `1f1b-offload` and what they cost.

A forward's saved activations go to host memory after it runs and come back before its
backward. Training is unchanged (to 1e-12 in float64, on the local engine and on gloo), the
device bytes the engine measures are the bytes model's at every instruction, the copies run on
a copy lane per stage in both simulators, and a misplaced copy is refused by a named rule.
"""

from __future__ import annotations

import copy
import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _models import batches, make_segments, mse, sgd
from _mutations import accepted, trains_exactly
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import PLAIN_BUILTINS
from torch import nn

import schedcc
from schedcc import Backward, CostModel, MemoryModel, Offload, OffloadError, Reload, Schedule
from schedcc.backends.local import Engine
from schedcc.backends.reference import assert_matches_reference
from schedcc.backends.run.launch import spawn
from schedcc.backends.runtime.memory import measure_memory
from schedcc.errors import ScheduleConfigError, ScheduleError
from schedcc.ir import COMM, parse
from schedcc.passes.insert_offload import ByteLimit
from schedcc.schedules.one_f_one_b_offload import OneFOneBOffload
from schedcc.semantics import held_bytes, host_bytes
from schedcc.testing import Shape, schedules

BUILT_INS = sorted({schedcc.get_schedule(n) for n in PLAIN_BUILTINS}, key=str)  # plain segments
_COMM = frozenset(COMM)


def _shape(cls) -> Shape:
    """The smallest shape of `cls` at 3 (else 4) stages with at least 2p microbatches, so that
    some forwards live long enough to offload."""
    return next(
        shape
        for p in (3, 4)
        for m in range(2 * p, 4 * p + 1)
        for v in (1, 2)
        if (shape := Shape(p, m, v, 1)).accepted_by(cls)
    )


def _offloads(program) -> int:
    return sum(type(op) is Offload for ops in program.stages for op in ops)


def _train(program, data):
    segments = make_segments(program.schedule.num_segments)
    if type(program.schedule).num_replicas > 1:  # model replicas hold the same modules
        length = program.schedule.num_segments // type(program.schedule).num_replicas
        segments = segments[:length] * type(program.schedule).num_replicas
    engine = Engine(program, segments, mse, sgd)
    return engine, list(engine.train(data)), segments


def test_offload_and_reload_print_and_parse():
    """`O3.1` / `L3` are an offload of microbatch 3 on chunk 1 / a reload on chunk 0, `parse`
    inverts them, and a compiled program's text parses back to its stages."""
    assert (str(Offload(3, chunk=1)), str(Reload(3))) == ("O3.1", "L3")
    assert parse("O3.1") == Offload(3, 1)
    assert parse("L3") == Reload(3)
    program = schedcc.compile(schedcc.get_schedule("interleaved-1f1b")(2, 4, 2), offload=True)
    assert _offloads(program) > 0
    assert schedcc.Program.parse_stages(program.to_text()) == program.stages


@pytest.mark.parametrize("cls", BUILT_INS, ids=lambda cls: cls.name)
def test_every_builtin_with_offload_trains_like_without_it(cls):
    """`compile(s, offload=True)` trains to the losses and weights of `compile(s)` within 1e-12
    (float64), and to non-pipelined training; some forward is offloaded."""
    schedule = _shape(cls).build(cls)
    program = schedcc.compile(schedule, offload=True)
    plain = schedcc.compile(schedule)
    assert _offloads(program) > 0
    data = batches(2, 2 * schedule.num_microbatches)
    _, losses, trained = _train(program, data)
    _, expected, reference = _train(plain, data)
    assert max(abs(a - b) for a, b in zip(losses, expected)) <= 1e-12
    for got, want in zip(trained, reference):
        for a, b in zip(got.parameters(), want.parameters()):
            assert torch.allclose(a, b, rtol=0, atol=1e-12)
    if type(schedule).num_replicas == 1:
        assert_matches_reference(program, make_segments(schedule.num_segments), mse, sgd, data)


@pytest.mark.parametrize(
    ("name", "v", "options"),
    [
        ("1f1b", 1, {"data_parallel": 2, "zero": 3}),
        ("zb-h1", 1, {"data_parallel": 2, "zero": 1}),
        ("2bw", 1, {}),
        ("interleaved-1f1b", 2, {"recompute": {0}}),
        ("1f1b-offload", 1, {"recompute": True, "grad_norm": True}),
    ],
)
def test_offload_combines_with_zero_recompute_and_weight_stashing(name, v, options):
    """Offloading under ZeRO-1/3 with two replicas, with 2BW's stashed weights, beside
    recomputation (each forward offloaded or recomputed, not both) and with a gradient norm
    trains like non-pipelined training."""
    schedule = schedcc.get_schedule(name)(3, 6, v)
    program = schedcc.compile(schedule, offload=True, **options)
    assert _offloads(program) > 0
    dp = options.get("data_parallel", 1)
    data = batches(2, 12 * dp)
    if dp > 1:  # each replica's local batch
        data = [[(x[:12], y[:12]), (x[12:], y[12:])] for x, y in data]
    assert_matches_reference(program, make_segments(schedule.num_segments), mse, sgd, data)


def _width_segments(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(
            nn.Linear(8, 8, dtype=torch.float64), nn.Tanh(), nn.Linear(8, 8, dtype=torch.float64)
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize(
    ("name", "offload"),
    [("1f1b-offload", False), ("1f1b", True), ("interleaved-1f1b", 0.5), ("zb-h1", True)],
)
def test_measured_device_bytes_equal_the_bytes_model_at_every_instruction(name, offload):
    """After every instruction a stage runs, the engine's measured device (and host) activation
    bytes are what `held_bytes` (and `host_bytes`) say with a measured memory model."""
    p, m, size = 3, 6, 2
    schedule = schedcc.get_schedule(name)(p, m, 2 if name.startswith("interleaved") else 1)
    program = schedcc.compile(schedule, offload=offload)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m * size, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(m * size, 8, generator=gen, dtype=torch.float64)
    segments = _width_segments(schedule.num_segments)
    memory = measure_memory(segments, x[:size], y[:size], mse)
    engine = Engine(program, segments, mse, sgd)
    measured = {s: [] for s in range(p)}
    for s, runtime in enumerate(engine.runtimes[0]):
        run = runtime.run

        def traced(op, run=run, runtime=runtime, s=s):
            run(op)
            measured[s].append((runtime.activation_bytes, runtime.host_activation_bytes))

        runtime.run = traced
    engine.train_step(x, y)
    for s, ops in enumerate(program.stages):
        sizes = [memory.activations[schedule.segment_of(s, c)] for c in range(schedule.num_chunks)]
        inputs = [memory.inputs[schedule.segment_of(s, c)] for c in range(schedule.num_chunks)]
        device, host = held_bytes(ops, sizes, inputs), host_bytes(ops, sizes)
        modelled = [(device[pos], host[pos]) for pos, op in enumerate(ops) if type(op) not in _COMM]
        assert measured[s] == modelled, s
    assert any(h for row in measured.values() for _, h in row)  # something went to the host
    timeline = schedcc.simulate(program, CostModel(memory=memory))
    assert list(timeline.peak_activation_bytes) == engine.peak_activation_bytes


@pytest.mark.parametrize(("name", "p"), [("1f1b", 3), ("gpipe", 3), ("1f1b", 4)])
def test_one_microbatch_a_stage_fits_by_offloading_alone(name, p):
    """A byte limit of one microbatch's activations on every stage fits 1F1B and GPipe by
    offloading alone: a reload that cannot overlap the compute ahead waits right before its
    backward ([Note: a late reload]). Measured on the engine the stages hold no more, and it
    trains like non-pipelined training."""
    m, size = 2 * p, 2
    schedule = schedcc.get_schedule(name)(p, m)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(m * size, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(m * size, 8, generator=gen, dtype=torch.float64)
    segments = _width_segments(p)
    memory = measure_memory(segments, x[:size], y[:size], mse)
    limit = list(memory.activations)
    program = schedcc.compile(schedule, offload=ByteLimit(limit, memory))
    late = [  # an `L i` that the backward of i follows, comm aside
        op
        for ops in program.stages
        for n, op in enumerate(ops)
        if type(op) is Reload
        and next(o for o in ops[n + 1 :] if type(o) not in _COMM) == Backward(op.microbatch)
    ]
    assert late
    timeline = schedcc.simulate(program, CostModel(memory=memory))
    assert list(timeline.peak_activation_bytes) == limit
    engine = Engine(program, segments, mse, sgd)
    engine.train_step(x, y)
    assert engine.peak_activation_bytes == limit
    assert_matches_reference(program, _width_segments(p), mse, sgd, [(x, y)])


def test_1f1b_offload_halves_the_peak_at_the_same_speed():
    """1f1b-offload at p = 8, m = 32 (F = 1, B = 2, each copy 0.5): the peak device activation
    bytes are at most half of 1F1B's and the makespan within 5% of it, under both simulators."""
    p, m = 8, 32
    memory = MemoryModel(activations=[1.0] * p, parameters=[0.0] * p)
    costs = CostModel(forward=1, backward=2, offload=0.5, reload=0.5, memory=memory)
    plain = schedcc.compile(schedcc.get_schedule("1f1b")(p, m))
    offloaded = schedcc.compile(schedcc.get_schedule("1f1b-offload")(p, m))
    for eager in (False, True):
        base = schedcc.simulate(plain, costs, eager=eager)
        timeline = schedcc.simulate(offloaded, costs, eager=eager)
        assert max(timeline.peak_activation_bytes) <= max(base.peak_activation_bytes) / 2
        assert timeline.makespan <= 1.05 * base.makespan
    assert max(timeline.peak_host_bytes) > 0


@given(schedules(OneFOneBOffload, max_stages=6, max_microbatches=16, max_batches=2))
def test_1f1b_offload_holds_two_on_the_device_at_1f1b_speed(schedule):
    """At any shape, 1f1b-offload validates, holds at most 2 activations per stage on the device
    and no more than 1F1B, and with copies as long as a forward takes 1F1B's makespan."""
    program = schedcc.compile(schedule)
    shape = (schedule.num_stages, schedule.num_microbatches)
    plain = schedcc.compile(schedcc.get_schedule("1f1b")(*shape, num_batches=schedule.num_batches))
    costs = CostModel(offload=1.0, reload=1.0)
    timeline = schedcc.simulate(program, costs)
    base = schedcc.simulate(plain, costs)
    assert max(timeline.peak_activations) <= 2
    assert all(a <= b for a, b in zip(timeline.peak_activations, base.peak_activations))
    assert timeline.makespan == base.makespan


@given(schedules(OneFOneBOffload, max_stages=3, max_microbatches=6, max_batches=2))
def test_1f1b_offload_trains_exactly_at_any_shape(schedule):
    """1f1b-offload trains like non-pipelined training at small random shapes."""
    trains_exactly(schedcc.compile(schedule))


@given(
    st.sampled_from([cls for cls in BUILT_INS if cls is not OneFOneBOffload]),
    st.integers(1, 4),
    st.integers(1, 10),
    st.sampled_from([True, 0.5, 0.25]),
)
def test_the_offload_pass_only_lowers_device_activations(cls, p, m, offload):
    """`compile(s, offload=...)` on any built-in and shape validates and holds no more device
    activations on any stage than without it."""
    shape = next((Shape(p, m, v, 1) for v in (1, 2) if Shape(p, m, v, 1).accepted_by(cls)), None)
    assume(shape is not None)
    schedule = shape.build(cls)
    program = schedcc.compile(schedule, offload=offload)
    plain = schedcc.compile(schedule)
    got, want = schedcc.simulate(program), schedcc.simulate(plain)
    assert all(a <= b for a, b in zip(got.peak_activations, want.peak_activations))
    assert got.makespan == want.makespan  # copies are free by default


@given(
    st.sampled_from([cls for cls in BUILT_INS if cls is not OneFOneBOffload]),
    st.integers(1, 4),
    st.integers(1, 10),
    st.lists(st.integers(1, 9), min_size=8, max_size=8),
    st.lists(st.integers(1, 40), min_size=4, max_size=4),
)
def test_a_byte_limit_offloads_only_what_a_point_over_it_needs(cls, p, m, sizes, limits):
    """`ByteLimit` with random sizes and one limit per stage: after the pass, every point of a
    stage's program still over its limit holds nothing more that could go (each forward held
    there that can be offloaded is, and none reloaded ahead of its backward could come back
    later: [Note: a late reload]), and each forward offloaded is held, and each reload delayed
    was back, at some point over the limit without them."""
    from schedcc.passes.insert_offload import (
        _fits,
        _Where,
        attach_copies,
        detach_copies,
        offload_points,
    )

    shape = next((Shape(p, m, v, 1) for v in (1, 2) if Shape(p, m, v, 1).accepted_by(cls)), None)
    assume(shape is not None)
    schedule = shape.build(cls)
    memory = MemoryModel(activations=sizes[: schedule.num_segments] * 2)
    plain = schedcc.compile(schedule)
    program = schedcc.compile(schedule, offload=ByteLimit(limits[:p], memory))
    for s, ops in enumerate(plain.stages):
        where = _Where(ops)
        early, late = (
            {k: c for k, c in offload_points(ops, late=lt).items() if _fits(ops, c, where)}
            for lt in (False, True)
        )
        span = {k: (where(off), where(back)) for k, (off, back) in late.items()}
        back = {k: where(early[k][1]) for k in early}  # where an early reload goes
        anchors = detach_copies(program.stages[s])[1]
        chosen = {(copy.microbatch, copy.chunk) for copy, _, _ in anchors}
        delayed = {k for k in chosen if late[k][1] in anchors}
        chunks = range(schedule.num_chunks)
        per_chunk = [memory.at("activations", schedule.segment_of(s, c)) for c in chunks]

        def over(anchors, ops=ops, where=where, per_chunk=per_chunk, s=s):
            """At each point over the limit with `anchors`: how many of `ops` have run, and
            the forwards on the host there."""
            row = attach_copies(ops, anchors, where)
            inserted = {copy for copy, _, _ in anchors}
            done, out, host = 0, [], set()
            for op, held in zip(row, held_bytes(row, per_chunk)):
                done += op not in inserted
                if op in inserted:
                    (host.add if type(op) is Offload else host.discard)((op.microbatch, op.chunk))
                if held > limits[s]:
                    out.append((done, set(host)))
            return out

        for done, host in over(anchors):
            assert all(k in chosen for k, (a, b) in span.items() if a <= done < b)
            early_back = {k for k in chosen - delayed - host if k in back}
            assert not any(back[k] <= done < span[k][1] for k in early_back)
        before = [done for done, _ in over([])]
        for k in chosen:
            assert any(span[k][0] <= done < span[k][1] for done in before)
        for k in delayed & set(back):  # at the end too: over before the late reload lands
            assert any(back[k] <= done <= span[k][1] for done in before)


class _Written(Schedule):
    """A schedule that yields the orders it is given, one string per stage."""

    name = "written"
    orders: tuple[str, ...] = ()

    def order(self, stage):
        yield from (parse(word) for word in self.orders[stage].split())


def _written(*orders: str) -> Schedule:
    return type("Written", (_Written,), {"orders": orders})(len(orders), 2)


def test_the_copy_lane_overlaps_compute_but_not_copies():
    """On one stage, F0 O0 F1 L0 B1 B0 with copies of 0.5 costs nothing (they hide behind F1 and
    B1); with copies of 3 the reload waits for the offload on the lane and B0 for the reload."""
    schedule = _written("F0 O0 F1 L0 B1 B0")
    program = schedcc.compile(schedule)
    for eager in (False, True):
        cheap = schedcc.simulate(program, CostModel(offload=0.5, reload=0.5), eager=eager)
        assert cheap.makespan == 6
        slow = schedcc.simulate(program, CostModel(offload=3, reload=3), eager=eager)
        spans = {str(e.instruction): (e.start, e.end) for e in slow.events}
        assert (spans["O0"], spans["L0"], spans["B1"], spans["B0"]) == (
            (1, 4),
            (4, 7),
            (2, 4),
            (7, 9),
        )
        assert slow.makespan == 9


@pytest.mark.parametrize(
    ("orders", "what"),
    [
        (("F0 F1 O0 B1 B0",), "while its activations are offloaded"),
        (("F0 F1 O0 O0 L0 B1 B0",), "a second time"),
        (("F0 F1 L0 B1 B0",), "not offloaded"),
        (("O0 F0 F1 L0 B1 B0",), "before its forward"),
        (("F0 F1 B1 B0 O0 L0",), "after its backward began"),
        (("F0 F1 O0 L0 R0 B1 B0",), "recomputed"),
        (("F0 O0 SA0 F1 SA1 RG1 B1 RG0 L0 B0", "RA0 F0 RA1 F1 B1 SG1 B0 SG0"), "after this send"),
    ],
)
def test_a_misplaced_copy_is_refused_by_the_offload_rule(orders, what):
    """A backward before its reload, a double offload, a reload without an offload, an offload
    before its forward, after its backward or of a recomputed forward, and a send of offloaded
    data are each an `OffloadError` with the grid."""
    with pytest.raises(OffloadError, match=what) as info:
        schedcc.compile(_written(*orders))
    assert isinstance(info.value, ScheduleError)
    assert "<-- here" in str(info.value)


def test_the_runtime_refuses_a_backward_of_offloaded_activations():
    """A stage runtime given an unvalidated program refuses a backward whose activations are
    on the host with a `RuntimeInstructionError` naming it, not a wrong gradient."""
    from schedcc.backends.runtime.stage import StageRuntime

    program = schedcc.compile(_written("F0 F1 O0 B1 B0"), validate=False)
    runtime = StageRuntime(program, 0, make_segments(1), mse, sgd)
    ((x, y),) = batches(1, 4)
    runtime.load_batch(0, list(x.chunk(2)), list(y.chunk(2)))
    for op in program.stages[0][:4]:
        runtime.run(op)
    with pytest.raises(schedcc.errors.RuntimeInstructionError, match=r"B0 .*Reload"):
        runtime.run(program.stages[0][4])


def test_offload_policies_pick_stages_chunks_fractions_and_bytes():
    """A set of stages, of (stage, chunk) pairs, a callable, a fraction or a byte limit picks
    which forwards are offloaded; a bad policy is a `ScheduleConfigError` naming `offload`."""
    schedule = schedcc.get_schedule("interleaved-1f1b")(2, 8, 2)

    def where(program):
        return {
            (s, op.chunk)
            for s, ops in enumerate(program.stages)
            for op in ops
            if type(op) is Offload
        }

    every = schedcc.compile(schedule, offload=True)
    assert where(schedcc.compile(schedule, offload={1})) == {(1, 0), (1, 1)} & where(every)
    assert where(schedcc.compile(schedule, offload={(0, 1)})) == {(0, 1)}
    assert where(schedcc.compile(schedule, offload=lambda s, c: c == 0)) <= {(0, 0), (1, 0)}
    half = schedcc.compile(schedule, offload=0.5)
    for ops, all_ops in zip(half.stages, every.stages):
        count, total = (sum(type(op) is Offload for op in row) for row in (ops, all_ops))
        assert count == -(-total // 2)
    memory = MemoryModel(activations=[10.0] * 4, parameters=[0.0] * 4)

    def peaks(program):
        return schedcc.simulate(program, CostModel(memory=memory)).peak_activation_bytes

    assert peaks(schedcc.compile(schedule)) == (50, 30)
    fitted = schedcc.compile(schedule, offload=ByteLimit(40, memory))
    assert peaks(fitted) == (40, 30)  # stage 1 fits already: it offloads nothing
    assert {s for s, _ in where(fitted)} == {0}
    assert 0 < _offloads(fitted) < _offloads(every)
    assert peaks(schedcc.compile(schedule, offload=ByteLimit(20, memory))) == (20, 20)  # late
    per_stage = schedcc.compile(schedule, offload=ByteLimit([50, 20], memory))
    assert peaks(per_stage) == (50, peaks(every)[1])  # one limit per stage
    assert {s for s, _ in where(per_stage)} == {1}
    for sizes in ([], [40, 0], [40]):
        with pytest.raises(ScheduleConfigError, match="ByteLimit"):
            schedcc.compile(schedule, offload=ByteLimit(sizes, memory))
    for bad in ({5}, {(0, 2)}, "all", 3, 1.5, lambda s, c: "yes"):
        with pytest.raises(ScheduleConfigError, match="offload"):
            schedcc.compile(schedule, offload=bad)


def test_the_drawings_show_the_copy_lane():
    """The terminal drawing has a copy row under each stage that copies, the Chrome trace a
    copy track, and the figure saves."""
    program = schedcc.compile(schedcc.get_schedule("1f1b-offload")(3, 6))
    timeline = schedcc.simulate(program, CostModel(offload=0.5, reload=0.5))
    lines = timeline.to_ascii(color=False, width=200).splitlines()
    assert [line.split("|")[0].strip() for line in lines[1:]] == [
        "stage 0", "copy", "stage 1", "copy", "stage 2",
    ]  # fmt: skip
    assert {"O", "L"} <= set(lines[2])


def test_chrome_trace_puts_copies_on_their_own_track(tmp_path):
    """Each stage's copies are on a track named "stage s copy", apart from its computes."""
    program = schedcc.compile(schedcc.get_schedule("1f1b-offload")(2, 4))
    timeline = schedcc.simulate(program, CostModel(offload=0.5, reload=0.5))
    trace = json.loads(timeline.to_chrome_trace(tmp_path / "t.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert names == {"stage 0", "stage 1", "stage 0 copy"}
    tracks = {e["name"][0]: e["tid"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert tracks["O"] != tracks["F"]


_MUTABLE = [("1f1b-offload", 1, True), ("1f1b", 1, True), ("interleaved-1f1b", 2, 0.5)]


@given(
    st.sampled_from(_MUTABLE),
    st.integers(2, 3),
    st.lists(
        st.tuples(st.sampled_from(["drop", "move", "duplicate"]), st.floats(0, 1, exclude_max=True),
                  st.floats(0, 1, exclude_max=True), st.floats(0, 1, exclude_max=True)),
        min_size=1, max_size=2,
    ),
)  # fmt: skip
def test_a_mutated_offload_program_is_refused_or_trains_exactly(base, p, edits):
    """Dropping, moving or duplicating an `Offload` or `Reload` of a compiled program gives a
    program the validator refuses, or one that trains like non-pipelined training."""
    name, v, offload = base
    program = schedcc.compile(schedcc.get_schedule(name)(p, 2 * p, v), offload=offload)
    stages = [list(ops) for ops in program.stages]
    for kind, at_stage, at, to in edits:
        ops = stages[int(at_stage * len(stages))]
        copies = [pos for pos, op in enumerate(ops) if type(op) in (Offload, Reload)]
        if not copies:
            continue
        j, k = copies[int(at * len(copies))], int(to * len(ops))
        if kind == "drop":
            del ops[j]
        elif kind == "move":
            ops.insert(k, ops.pop(j))
        else:
            ops.insert(k, ops[j])
    mutated = program.evolve(stages=tuple(tuple(ops) for ops in stages))
    if accepted(mutated):
        trains_exactly(mutated)


def _gloo_worker(rank: int, world_size: int) -> int:
    from schedcc.backends.distributed import Engine as DistributedEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    for name, v, offload in [("1f1b-offload", 1, False), ("interleaved-1f1b", 2, True)]:
        schedule = schedcc.get_schedule(name)(world_size, 6, v)
        program = schedcc.compile(schedule, offload=offload)
        segments = make_segments(schedule.num_segments)
        oracle = copy.deepcopy(segments)
        data = batches(2, 12)
        engine = DistributedEngine(program, segments, mse, sgd, timeout=30)
        losses = list(engine.train(data))
        expected = list(Engine(schedcc.compile(schedule), oracle, mse, sgd).train(data))
        assert max(abs(a - b) for a, b in zip(losses, expected)) <= 1e-12, (name, losses)
        for c in range(schedule.num_chunks):
            k = schedule.segment_of(engine.stage, c)
            for got, want in zip(segments[k].parameters(), oracle[k].parameters()):
                assert torch.allclose(got, want, rtol=0, atol=1e-12), (name, k)
        assert engine.runtime.peak_host_activation_bytes > 0 or engine.stage == world_size - 1
    dist.destroy_process_group()
    return 0


@pytest.mark.distributed
def test_offloaded_training_on_gloo_equals_the_local_engine_without_offload():
    """On 2 gloo ranks, 1f1b-offload and interleaved 1F1B with `offload=True` train to the local
    engine's losses and weights without offloading, within 1e-12."""
    assert spawn(_gloo_worker, 2, grace=30, threads=1) == 0


def test_show_offload_draws_the_copy_lane_and_the_host_bytes(capsys):
    """`schedcc show --offload --costs O=0.5,L=0.5 --memory ...` draws copy rows and prints the
    device and the host peak bytes per stage."""
    from schedcc.cli import main

    argv = ["show", "--schedule", "1f1b", "-p", "3", "-m", "6", "--offload"]
    costs = ["--costs", "O=0.5,L=0.5", "--memory", "activations=1MiB,parameters=0"]
    assert main([*argv, *costs]) == 0
    out = capsys.readouterr().out
    assert "  copy" in out
    assert "peak bytes per stage [2.00 MiB, 2.00 MiB, 1.00 MiB]" in out
    assert "on the host: peak bytes per stage [2.00 MiB, 1.00 MiB, 0 B]" in out
