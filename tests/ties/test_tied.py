"""Tied parameters in the core: `ReduceTied`, `compile(tied=...)`, its placement, the validator's
rules, the rendezvous model's collective and the simulators' cost of it."""

from __future__ import annotations

import pytest
from _orders import random_orders
from hypothesis import given
from hypothesis import strategies as st

import schedcc
from schedcc import (
    Backward,
    CostModel,
    Forward,
    Program,
    ReduceTied,
    Schedule,
    compile,
    get_schedule,
    simulate,
)
from schedcc.errors import DeadlockError, ScheduleConfigError, UpdateOrderError
from schedcc.ir import UPDATE, WEIGHT_GRADIENT, OptimizerStep, ReduceGrads, parse
from schedcc.semantics import Layout
from schedcc.validate import validate

BUILT_INS = [
    ("gpipe", {}),
    ("1f1b", {}),
    ("interleaved-1f1b", {"num_chunks": 2}),
    ("zb-h1", {}),
    ("zb-v", {"num_chunks": 2}),
    ("2bw", {}),
]


def _program(text: str, p: int, m: int, tied, *, data_parallel: int = 1) -> Program:
    schedule = get_schedule("gpipe")(p, m)
    return Program(schedule, Program.parse_stages(text), data_parallel, tied=tied)


def _errors(program: Program) -> list:
    return validate(program, collect=True)


def test_reduce_tied_prints_and_parses():
    """`ReduceTied(g)` prints as `Tied<g>`, `parse` inverts it, and it is an update."""
    assert str(ReduceTied(2)) == "Tied2"
    assert parse("Tied0") == ReduceTied(0) == ReduceTied()
    assert ReduceTied in UPDATE
    assert ReduceTied.group == "update"
    assert schedcc.ReduceTied is ReduceTied


@pytest.mark.parametrize(
    ("tied", "expected"),
    [
        ([(3, 0)], ((0, 3),)),
        ([[5, 1], (0, 2, 2)], ((0, 2), (1, 5))),
        ((), ()),
        ([(0, -1)], ((0, 5),)),
        ([(-6, -2, 1)], ((0, 1, 4),)),
    ],
)
def test_compile_normalises_tied(tied, expected):
    """`tied` becomes a sorted tuple of sorted tuples, kept on the program; a negative index
    counts from the last segment."""
    program = compile(get_schedule("1f1b")(6, 6), tied=tied)
    assert program.tied == expected
    assert program.evolve(zero=0).tied == expected


@pytest.mark.parametrize(
    ("tied", "words"),
    [
        ([(0,)], "fewer than two"),
        ([(0, 0)], "fewer than two"),
        ([(0, 4)], "not a segment index"),
        ([(0, -5)], "not a segment index"),
        ([(3, -1)], "fewer than two"),
        ([(0, 1), (1, 2)], "two tied groups"),
        ("01", "groups of segment indices"),
        ([3], "tuple of segment indices"),
        ([(0, 1.0)], "not a segment index"),
    ],
)
def test_compile_refuses_bad_tied(tied, words):
    """A group of fewer than two segments, out of range or overlapping another is refused."""
    with pytest.raises(ScheduleConfigError, match=words):
        compile(get_schedule("1f1b")(4, 4), tied=tied)


@pytest.mark.parametrize("p", [2, 4])
def test_a_negative_index_counts_from_the_end_of_one_replica(p):
    """`(0, -1)` ties the first and last segments at any cut; under DualPipe, those of one
    model replica (each tied to its copy in the other too)."""
    for v in (1, 2):
        schedule = get_schedule("interleaved-1f1b")(p, 2 * p, num_chunks=v) if v > 1 else (
            get_schedule("1f1b")(p, 2 * p)
        )
        assert compile(schedule, tied=[(0, -1)]).tied == ((0, p * v - 1),)
    dual = get_schedule("dualpipe")(p, 2 * p)
    assert compile(dual, tied=[(0, -1)]).tied == compile(dual, tied=[(0, p - 1)]).tied


@pytest.mark.parametrize(("name", "kwargs"), BUILT_INS)
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize(("dp", "zero"), [(1, 0), (2, 0), (2, 1), (1, 2)])
def test_every_member_sums_once_per_batch_before_reduce_and_step(name, kwargs, p, dp, zero):
    """Each stage of the group runs one ReduceTied per batch, after its last weight gradient of
    the tied chunks and before their ReduceGrads and the step; other stages run none."""
    schedule = get_schedule(name)(p, 2 * p, num_batches=3, **kwargs)
    last = schedule.num_segments - 1
    program = compile(schedule, tied=[(0, last)], data_parallel=dp, zero=zero)
    layout = Layout.of(schedule)
    members = {layout.stage_of[0], layout.stage_of[last]}
    for s, ops in enumerate(program.stages):
        chunks = {layout.chunk_of[k] for k in (0, last) if layout.stage_of[k] == s}
        ties = [pos for pos, op in enumerate(ops) if type(op) is ReduceTied]
        steps = [pos for pos, op in enumerate(ops) if type(op) is OptimizerStep]
        assert len(ties) == (3 if s in members else 0)
        for batch, (tie, step) in enumerate(zip(ties, steps)):
            assert tie < step
            grads = [
                pos
                for pos, op in enumerate(ops)
                if isinstance(op, WEIGHT_GRADIENT)
                and op.chunk in chunks
                and op.microbatch // schedule.num_microbatches == batch
            ]
            assert max(grads) < tie
            reduces = [
                pos
                for pos, op in enumerate(ops[: steps[batch]])
                if type(op) is ReduceGrads and op.chunk in chunks and pos > max(grads)
            ]
            assert all(pos > tie for pos in reduces)


def test_copies_on_one_stage_meet_nobody():
    """zb-v puts segments 0 and 2p - 1 on stage 0: its ReduceTied is a collective of one."""
    program = compile(get_schedule("zb-v")(3, 6, 2), tied=[(0, 5)])
    model = program.rendezvous_model
    ties = [pos for pos, op in enumerate(program.stages[0]) if type(op) is ReduceTied]
    assert len(ties) == 1
    assert all(type(op) is not ReduceTied for op in program.stages[1])
    assert model.meets[0][ties[0]] == ()


def test_a_schedule_that_yields_updates_must_yield_reduce_tied():
    """Updates are all-or-nothing: a schedule yielding its own steps but no ReduceTied is
    refused when compiled with tied segments."""

    class OwnOrder(Schedule):
        name = "own-steps"

        def order(self, stage):
            yield Forward(0)
            yield Backward(0)
            yield OptimizerStep()

    compile(OwnOrder(2, 1))
    with pytest.raises(UpdateOrderError, match=r"before ReduceTied\(0\)"):
        compile(OwnOrder(2, 1), tied=[(0, 1)])


GPIPE_TIED = """
stage 0: F0 SA0 RG0 B0 Tied0 Step
stage 1: RA0 F0 B0 SG0 Tied0 Step
"""


def test_a_valid_tied_program_validates():
    """The written-out program of gpipe p=2 m=1 with its tie validates."""
    assert _errors(_program(GPIPE_TIED, 2, 1, ((0, 1),))) == []


def test_missing_reduce_tied_is_refused():
    """A stage of the group without its ReduceTied: it steps before summing, and the other
    member's collective meets nothing."""
    text = GPIPE_TIED.replace("B0 SG0 Tied0", "B0 SG0")
    errors = _errors(_program(text, 2, 1, ((0, 1),)))
    messages = " | ".join(str(e) for e in errors)
    assert all(isinstance(e, UpdateOrderError) for e in errors)
    assert len(errors) == 2
    assert "no partner on stage 1" in messages
    assert "steps batch 0 before ReduceTied(0)" in messages
    assert {(e.stage, e.position) for e in errors} == {(0, 4), (1, 4)}


def test_reduce_tied_on_a_stage_outside_the_group_is_refused():
    """A ReduceTied on a stage that holds none of the group's segments meets nothing."""
    text = """
    stage 0: F0 SA0 RG0 B0 Tied0 Step
    stage 1: RA0 F0 SA0 RG0 B0 SG0 Tied0 Step
    stage 2: RA0 F0 B0 SG0 Tied0 Step
    """
    (error,) = _errors(_program(text, 3, 1, ((0, 2),)))
    assert isinstance(error, UpdateOrderError)
    assert (error.stage, error.position) == (1, 6)
    assert "holds none of tied group 0's segments (0, 2)" in str(error)
    assert "<-- here" in str(error)


@pytest.mark.parametrize(
    ("stage0", "stage1", "words"),
    [
        ("F0 SA0 RG0 B0 Step Tied0", "RA0 F0 B0 SG0 Tied0 Step", "before ReduceTied(0)"),
        ("F0 SA0 Tied0 RG0 B0 Step", "RA0 F0 B0 SG0 Tied0 Step", "after only 0 of the 1"),
        ("F0 SA0 RG0 B0 Tied0 Tied0 Step", "RA0 F0 B0 SG0 Tied0 Tied0 Step", "second"),
        ("F0 SA0 RG0 B0 Tied1 Step", "RA0 F0 B0 SG0 Tied1 Step", "1 tied group"),
    ],
)
def test_misplaced_reduce_tied_is_refused(stage0, stage1, words):
    """After the step, before the last backward, twice in a batch, or of a group the program
    does not have: each is refused with the rule's error."""
    program = _program(f"stage 0: {stage0}\nstage 1: {stage1}", 2, 1, ((0, 1),))
    rules = [str(e) for e in _errors(program) if isinstance(e, UpdateOrderError)]
    assert any(words in text for text in rules), rules


def test_reduce_tied_after_reduce_grads_is_refused():
    """With data parallelism, the tied chunk's ReduceGrads must come after the ReduceTied."""
    text = """
    stage 0: F0 SA0 RG0 B0 Reduce Tied0 Step
    stage 1: RA0 F0 B0 SG0 Tied0 Reduce Step
    """
    (error,) = _errors(_program(text, 2, 1, ((0, 1),), data_parallel=2))
    assert (error.stage, error.position) == (0, 5)
    assert "already reduced the gradients of a tied chunk" in str(error)


def test_a_cycle_through_reduce_tied_is_a_deadlock():
    """Stage 1 sums before it sends the gradient stage 0 needs before its own sum: the wait-for
    chain runs through the collective."""
    text = """
    stage 0: F0 SA0 RG0 B0 Tied0 Step
    stage 1: RA0 F0 B0 Tied0 SG0 Step
    """
    with pytest.raises(DeadlockError) as info:
        validate(_program(text, 2, 1, ((0, 1),)))
    message = str(info.value)
    assert "stage 0 waits at RG0 (position 2) for stage 1's SG0 (position 4)" in message
    assert "stage 1 waits at Tied0 (position 3) for stage 0's Tied0 (position 4)" in message
    assert "Move the ReduceTied" in message


def test_simulate_costs_reduce_tied_as_a_collective():
    """`CostModel(reduce=r)` costs each ReduceTied r, once every member has arrived: both
    members end it together, r after the later one arrives."""
    schedule = get_schedule("gpipe")(2, 2)
    plain, tied = compile(schedule), compile(schedule, tied=[(0, 1)])
    costs = CostModel(reduce=1.5)
    assert simulate(tied, costs).makespan == simulate(plain, costs).makespan + 1.5
    for eager in (False, True):
        events = [
            e for e in simulate(tied, costs, eager=eager).events if e.instruction.code == "Tied"
        ]
        assert len(events) == 2
        assert len({e.end for e in events}) == 1
        assert events[0].end - max(e.start for e in events) == pytest.approx(1.5)


@given(random_orders(), st.sampled_from([(1, 0), (2, 0), (2, 1), (1, 2)]))
def test_random_orders_with_a_tie_compile_and_validate(schedule, parallel):
    """Every dependency-respecting compute order with its first and last segment tied compiles
    (the compiler places the ReduceTied) and validates, with data parallelism and ZeRO."""
    last = schedule.num_segments - 1
    if last == 0:
        return
    dp, zero = parallel
    program = compile(schedule, tied=[(0, last)], data_parallel=dp, zero=zero)
    assert validate(program, collect=True) == []
    simulate(program, CostModel(reduce=0.5), eager=True)
