"""ZeRO-3 in the compiler, the validator and the simulators: `Unshard`/`Reshard` placement,
the sharding rule, the gather cost, and random built-in shapes end to end."""

from __future__ import annotations

import pytest
from _models import batches, make_segments, mse, sgd
from _mutations import accepted, mutate, mutations, trains_exactly
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import PLAIN_BUILTINS

import schedcc
from schedcc import CostModel, simulate
from schedcc.backends.reference import assert_matches_reference
from schedcc.errors import ScheduleConfigError, ScheduleError, ShardingError
from schedcc.ir import SHARDING, Compute, OptimizerStep, Reshard, Unshard, parse
from schedcc.program import Program
from schedcc.testing import shapes

#: Built-ins without a weight delay or model replicas (ZeRO-3 refuses both: replicas are tied),
#: on plain segments (sequence parts train carry segments: tests/engine/test_seq_parts.py).
FLUSHED = [
    name
    for name in PLAIN_BUILTINS
    if not schedcc.get_schedule(name).weight_delay and schedcc.get_schedule(name).num_replicas == 1
]


def _program(name: str = "1f1b", p: int = 2, m: int = 4, v: int = 1, **kwargs) -> Program:
    schedule = schedcc.get_schedule(name)(p, m, num_chunks=v, **kwargs)
    return schedcc.compile(schedule, data_parallel=2, zero=3)


def _with(program: Program, stage: int, ops) -> Program:
    stages = list(program.stages)
    stages[stage] = tuple(ops)
    return program.evolve(stages=tuple(stages))


def test_unshard_and_reshard_print_and_parse():
    """`Unshard.1` / `Reshard` print short and `parse` inverts them."""
    for op in (Unshard(), Unshard(1), Reshard(), Reshard(2)):
        assert parse(str(op)) == op
    assert [str(op) for op in (Unshard(1), Reshard())] == ["Unshard.1", "Reshard"]


def test_each_chunk_is_whole_exactly_around_its_computes_of_a_batch():
    """Per stage, batch and chunk: one Unshard before its first compute, one Reshard after its
    last, and the chunk released at every step."""
    program = _program("interleaved-1f1b", 2, 4, 2, num_batches=2)
    m = 4
    for ops in program.stages:
        whole: set[int] = set()
        seen: dict[tuple[int, int], int] = {}
        for op in ops:
            if type(op) is Unshard:
                assert op.chunk not in whole
                whole.add(op.chunk)
            elif type(op) is Reshard:
                whole.remove(op.chunk)
            elif isinstance(op, Compute):
                assert op.chunk in whole
                seen[op.microbatch // m, op.chunk] = 1
            elif type(op) is OptimizerStep:
                assert not whole
        assert sum(type(op) is Unshard for op in ops) == len(seen) == 4


def test_the_gather_is_prefetched_one_compute_early_where_the_schedule_allows():
    """Interleaved stage 0: chunk 1 is gathered before the compute ahead of its first forward;
    a chunk's first gather of a later batch waits for the step (it fetches the update)."""
    ops = _program("interleaved-1f1b", 2, 4, 2).stages[0]
    first = next(pos for pos, op in enumerate(ops) if isinstance(op, Compute) and op.chunk == 1)
    ahead = max(pos for pos in range(first) if isinstance(ops[pos], Compute))
    assert ops[ahead] == parse("F1")
    assert ops.index(Unshard(1)) == ahead - 1
    two = _program("1f1b", 2, 2, num_batches=2).stages[0]
    step = two.index(OptimizerStep())
    assert two[step + 1] == Unshard(0)


def test_the_validator_rejects_a_compute_on_a_released_chunk():
    """Dropping the first Unshard, or moving a Reshard before the chunk's last compute, is a
    ShardingError that names the compute."""
    program = _program()
    ops = list(program.stages[1])
    dropped = _with(program, 1, ops[1:])
    with pytest.raises(ShardingError, match="computes on chunk 0, whose parameters are released"):
        schedcc.validate(dropped)
    moved = [op for op in ops if type(op) is not Reshard]
    last = max(pos for pos, op in enumerate(moved) if isinstance(op, Compute))
    moved.insert(last, Reshard())
    errors = schedcc.validate(_with(program, 1, moved), collect=True)
    assert any(isinstance(e, ShardingError) and "released" in str(e) for e in errors)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda ops: [Unshard(), *ops], "already whole"),
        (lambda ops: [op for op in ops if type(op) is not Reshard], "whole; every Unshard"),
        (lambda ops: [Reshard(), *ops], "not whole"),
    ],
)
def test_unmatched_gathers_and_releases_are_rejected(edit, message):
    """A second Unshard, a missing Reshard, or a Reshard of a released chunk is refused."""
    program = _program()
    errors = schedcc.validate(_with(program, 0, edit(list(program.stages[0]))), collect=True)
    assert any(isinstance(e, ShardingError) and message in str(e) for e in errors), errors


def test_a_release_before_the_gradients_are_reduced_is_rejected():
    """A Reshard between a backward and its ReduceGrads would lose the gradients."""
    program = _program("gpipe", 2, 2)
    ops = [op for op in program.stages[0] if type(op) is not Reshard]
    last_reduce = max(pos for pos, op in enumerate(ops) if str(op) == "Reduce")
    ops.insert(last_reduce, Reshard())
    with pytest.raises(ShardingError, match="before its gradients are reduced"):
        schedcc.validate(_with(program, 0, ops))


def test_sharding_instructions_need_zero3():
    """Unshard/Reshard in a zero=2 program, and ZeRO-1's gather in a zero=3 one, are refused."""
    two = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2), data_parallel=2, zero=2)
    with pytest.raises(ShardingError, match="compile with zero=3"):
        schedcc.validate(_with(two, 0, [Unshard(), *two.stages[0]]))
    three = _program()
    with pytest.raises(ShardingError, match="ZeRO-1's gather"):
        schedcc.validate(_with(three, 0, [*three.stages[0], parse("Gather")]))


def test_zero3_refuses_a_weight_delay():
    """2BW keeps whole stashed copies, which ZeRO-3 would release: a typed error."""
    with pytest.raises(ScheduleConfigError, match="weight delay"):
        schedcc.compile(schedcc.get_schedule("2bw")(2, 2), data_parallel=2, zero=3)


def test_a_tied_chunk_stays_whole_until_its_copies_are_summed():
    """Under ZeRO-3 a tied chunk's Reduce follows its Tied, which sums whole gradients, and its
    Reshard follows that Reduce; an untied chunk still reduces after every weight gradient."""
    schedule = schedcc.get_schedule("zb-v")(2, 2)
    program = schedcc.compile(schedule, data_parallel=2, zero=3, tied=[(0, 3)])
    tied_stage, other = (str(ops) for ops in program.to_text().splitlines())
    assert tied_stage.endswith("Tied0 Reduce Reshard Reduce.1 Reshard.1 Step")
    assert tied_stage.count("Reduce") == 2
    assert other.count("Reduce") == 4  # segments 1 and 2: one per weight gradient


def test_the_simulator_costs_each_gather():
    """With `gather=0.5` every Unshard lasts 0.5 and `release=` prices each Reshard; a 1F1B
    stage that cannot hide its gather behind compute finishes that much later."""
    program = _program()
    base = simulate(program).makespan
    timeline = simulate(program, CostModel(gather=0.5, release=0.25))
    spans = {
        type(e.instruction): e.end - e.start
        for e in timeline.events
        if type(e.instruction) in SHARDING
    }
    assert spans == {Unshard: 0.5, Reshard: 0.25}
    assert timeline.makespan > base
    eager = simulate(program, CostModel(gather=0.5), eager=True)
    assert eager.makespan > simulate(program, eager=True).makespan


@settings(max_examples=10)
@given(st.data())
def test_random_built_in_shapes_with_zero3_compile_validate_simulate_and_train(data):
    """Any flushed built-in at a random shape compiles with zero=3 at dp=2, validates, simulates
    (a gather costs time) and trains to non-pipelined training on the local backend."""
    name = data.draw(st.sampled_from(FLUSHED))
    cls = schedcc.get_schedule(name)
    shape = data.draw(shapes(cls, max_stages=3, max_microbatches=4, max_chunks=2, max_batches=2))
    schedule = shape.build(cls)
    program = schedcc.compile(schedule, data_parallel=2, zero=3)
    assert schedcc.validate(program, collect=True) == []
    costly = simulate(program, CostModel(gather=1.0)).makespan
    assert costly > simulate(program).makespan
    data = batches(schedule.num_batches, 2 * schedule.num_microbatches)  # global batches
    assert_matches_reference(program, make_segments(schedule.num_segments), mse, sgd, data)


@settings(max_examples=15)
@given(st.data())
def test_dropping_any_sharding_instruction_is_a_schedule_error(data):
    """Removing one Unshard or Reshard from a valid zero=3 program never validates."""
    program = _program(data.draw(st.sampled_from(["gpipe", "1f1b", "zb-h1"])), 2, 3)
    stage = data.draw(st.integers(0, program.num_stages - 1))
    ops = list(program.stages[stage])
    where = [pos for pos, op in enumerate(ops) if type(op) in SHARDING]
    pos = data.draw(st.sampled_from(where))
    with pytest.raises(ScheduleError):
        schedcc.validate(_with(program, stage, ops[:pos] + ops[pos + 1 :]))


@settings(max_examples=40)
@given(
    st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"]),
    st.integers(1, 3),
    st.integers(1, 3),
    st.data(),
)
def test_a_mutated_zero3_program_is_rejected_or_trains_exactly(name, p, m, data):
    """Drop, duplicate, swap or move instructions of a zero=3 program, or insert an Unshard or
    Reshard anywhere: the validator raises a ScheduleError, or the local backend trains the
    result to the numbers of non-pipelined training."""
    v = 2 if name in ("interleaved-1f1b", "zb-v") else 1
    try:
        schedule = schedcc.get_schedule(name)(p, m, v)
    except ScheduleConfigError:
        return
    program = schedcc.compile(schedule, data_parallel=2, zero=3)
    stages = [list(ops) for ops in mutate(program.stages, data.draw(mutations(2)), v)]
    if data.draw(st.booleans()):
        ops = stages[data.draw(st.integers(0, len(stages) - 1))]
        op = data.draw(st.sampled_from([Unshard, Reshard]))(data.draw(st.integers(0, v - 1)))
        ops.insert(data.draw(st.integers(0, len(ops))), op)
    mutated = program.evolve(stages=tuple(map(tuple, stages)))
    if accepted(mutated):
        trains_exactly(mutated)


def test_tune_with_zero3_skips_weight_delayed_schedules_and_prices_gathers():
    """`tune(..., zero=3)` ranks the flushed schedules with their gathers' cost and skips 2BW
    (which ZeRO-3 cannot run) with the reason."""
    result = schedcc.tune(
        ["1f1b", "2bw"],
        num_stages=2,
        num_microbatches=4,
        num_chunks=1,
        data_parallel=2,
        zero=3,
        costs=CostModel(gather=0.5),
    )
    assert [c.schedule for c in result.ranked] == ["1f1b"]
    assert [s.schedule for s in result.skipped] == ["2bw"]
    assert "zero=3" in result.skipped[0].reason
    plain = schedcc.tune(["1f1b"], num_stages=2, num_microbatches=4, num_chunks=1)
    assert result.ranked[0].makespan > plain.ranked[0].makespan


def test_a_zero3_program_exports_torch_unshard_and_reshard():
    """With comms, a zero=3 program exports its gathers and releases as torch's FSDP actions
    (`0UNSHARD` ... `0RESHARD`), each a valid torch `_Action`, and imports back to the same
    computes and comm."""
    from torch.distributed.pipelining.schedules import _Action

    from schedcc.interop.torch import from_torch_actions, to_torch_actions

    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2), data_parallel=2, zero=3)
    rows = to_torch_actions(program)
    assert rows[0][0] == "0UNSHARD"
    assert rows[0][-1] == "0RESHARD"
    assert rows[1].index("1RESHARD") > rows[1].index("1REDUCE_GRAD")
    assert all(str(_Action.from_str(action)) == action for row in rows for action in row)
    back = schedcc.compile(from_torch_actions(rows, 2))
    for mine, theirs in zip(program.stages, back.stages):
        keep = ("comm", "compute")
        assert [op for op in mine if op.group in keep] == [op for op in theirs if op.group in keep]
