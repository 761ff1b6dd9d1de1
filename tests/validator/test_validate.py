"""The validator: one typed error per rule, each message naming stage, instruction and fix."""

from __future__ import annotations

import pytest
from _orders import OrderSchedule

import schedcc
from schedcc import (
    Backward,
    DeadlockError,
    DependencyError,
    Forward,
    IncompleteScheduleError,
    MemoryBoundError,
    Program,
    ScheduleError,
    UnmatchedCommError,
    WeightVersionError,
    validate,
)
from schedcc.errors import UpdateOrderError
from schedcc.validate import render_grid

GPIPE_2_2 = """
stage 0: F0 SA0 F1 SA1 RG1 B1 RG0 B0 Step
stage 1: RA0 F0 RA1 F1 B1 SG1 B0 SG0 Step
"""


def program(text: str, schedule=None) -> Program:
    """A program over `schedule` (GPipe p=2, m=2 by default) from its text form."""
    schedule = schedule or schedcc.get_schedule("gpipe")(2, 2)
    return Program(schedule, Program.parse_stages(text))


def kinds(errors) -> set[type]:
    return {type(error) for error in errors}


def test_reference_program_is_valid():
    """The compiler's own GPipe p=2, m=2 program validates (the base of the cases below)."""
    assert schedcc.compile(schedcc.get_schedule("gpipe")(2, 2)).to_text() == GPIPE_2_2.strip()
    assert validate(program(GPIPE_2_2), collect=True) == []


def test_incomplete_names_microbatch_segment_and_fix():
    """A missing backward is an IncompleteScheduleError naming what to yield and where."""
    text = GPIPE_2_2.replace("B1 SG1 B0 SG0 Step", "B1 SG1 Step")
    with pytest.raises(IncompleteScheduleError) as info:
        validate(program(text))
    message = str(info.value)
    assert "microbatch 0, segment 1 (stage 1, chunk 0)" in message
    assert "must yield either Backward(0, chunk=0) once" in message
    assert info.value.stage == 1


def test_incomplete_duplicate_forward():
    """A forward yielded twice is counted and reported."""
    text = GPIPE_2_2.replace("RA1 F1", "RA1 F1 F1")
    with pytest.raises(IncompleteScheduleError, match="forwarded 2 times"):
        validate(program(text))


def test_incomplete_missing_step():
    """A stage without its OptimizerStep is incomplete."""
    text = GPIPE_2_2.replace("SG0 Step", "SG0")
    with pytest.raises(IncompleteScheduleError, match="stage 1 has 0 OptimizerStep"):
        validate(program(text))


def test_dependency_backward_before_forward():
    """A backward before its forward on the same stage is a DependencyError saying the fix."""
    text = GPIPE_2_2.replace("RA0 F0 RA1 F1 B1 SG1 B0 SG0", "RA0 RA1 F1 B1 SG1 B0 SG0 F0")
    with pytest.raises(DependencyError) as info:
        validate(program(text))
    assert "stage 1, position 5 (B0) needs its forward F0 before it" in str(info.value)
    assert (info.value.stage, info.value.position) == (1, 5)


def test_dependency_weight_before_input():
    """A BackwardWeight before its BackwardInput is a DependencyError."""
    orders = [[Forward(0), schedcc.BackwardWeight(0), schedcc.BackwardInput(0)]]
    schedule = OrderSchedule(1, 1, orders=orders)
    with pytest.raises(DependencyError, match=r"W0 needs .* at position 2 \(I0\); move W0 after"):
        schedcc.compile(schedule)
    with pytest.raises(DependencyError, match=r"W0\) needs its BackwardInput I0 before it"):
        validate(program("stage 0: F0 W0 I0 Step", schedule))


def test_unmatched_duplicate_send():
    """A send posted twice (torch.distributed.pipelining accepts it) is an UnmatchedCommError."""
    text = GPIPE_2_2.replace("F1 SA1", "F1 SA1 SA1")
    with pytest.raises(UnmatchedCommError, match=r"SA1\) has no matching receive on stage 1"):
        validate(program(text))
    text = GPIPE_2_2.replace("F0 SA0", "F0 SA0 SA0")
    with pytest.raises(UnmatchedCommError, match=r"SA0\) moves a tensor that is already moved"):
        validate(program(text))


def test_unmatched_missing_recv():
    """A send whose receive is missing is an UnmatchedCommError on the sending stage."""
    text = GPIPE_2_2.replace("RG1 B1", "B1")
    errors = validate(program(text), collect=True)
    comm = [e for e in errors if isinstance(e, UnmatchedCommError)]
    assert len(comm) == 1
    assert "stage 1, position 5 (SG1) has no matching receive on stage 0" in str(comm[0])
    assert "hangs on NCCL" in str(comm[0])


def test_unmatched_missing_send():
    """A receive whose send is missing is reported on the receiving stage with the fix."""
    text = GPIPE_2_2.replace("B1 SG1 B0", "B1 B0")
    errors = validate(program(text), collect=True)
    comm = [e for e in errors if isinstance(e, UnmatchedCommError)]
    assert comm
    assert "stage 0, position 4 (RG1) has no matching send on stage 1" in str(comm[0])
    assert "add the send there or remove this op" in str(comm[0])


def test_unmatched_swapped_recvs():
    """Receives swapped within one group break FIFO order on the channel: UnmatchedCommError."""
    text = GPIPE_2_2.replace("RA0 F0 RA1 F1", "RA1 RA0 F0 F1")
    with pytest.raises(UnmatchedCommError) as info:
        validate(program(text))
    assert "FIFO order on channel 0->1" in str(info.value)
    assert "order the sends and receives of a channel alike" in str(info.value)


def test_unmatched_comm_with_nothing_to_move():
    """A send out of the last segment has no peer: remove it."""
    text = GPIPE_2_2.replace("B1 SG1", "B1 SA1 SG1")
    with pytest.raises(UnmatchedCommError, match="has nothing to move"):
        validate(program(text))


def test_deadlock_prints_wait_for_chain():
    """Cross-waiting groups raise DeadlockError whose message walks the cycle stage by stage."""
    text = GPIPE_2_2.replace("F0 SA0 F1 SA1 RG1 B1", "F0 F1 RG1 B1 SA0 SA1")
    with pytest.raises(DeadlockError) as info:
        validate(program(text))
    message = str(info.value)
    assert "stage 0 waits at RG1 (position 2) for stage 1's SG1 (position 5)" in message
    assert "stage 1 waits at RA0 (position 0) for stage 0's SA0 (position 4)" in message
    assert "back to stage 0" in message
    assert message.index("stage 0 waits") < message.index("stage 1 waits")


def test_deadlock_in_compute_order_is_reported_by_compile():
    """Two stages each waiting for the other's output cannot be lowered: DeadlockError."""
    orders = [
        [Forward(1), Backward(1), Forward(0), Backward(0)],
        [Forward(0), Backward(0), Forward(1), Backward(1)],
    ]
    with pytest.raises(DeadlockError, match="stage 0 waits at") as info:
        schedcc.compile(OrderSchedule(2, 2, orders=orders))
    assert "stage 1 waits at" in str(info.value)


def test_weight_version_not_yet_produced():
    """A forward of batch 1 before the step that produces version 1 is a WeightVersionError."""
    schedule = OrderSchedule(1, 1, num_batches=2)
    text = "stage 0: F0 B0 F1 Step B1 Step"
    with pytest.raises(WeightVersionError) as info:
        validate(program(text, schedule))
    message = str(info.value)
    assert "stage 0, position 2 (F1) needs weight version 1 (batch 1, weight_delay 0)" in message
    assert "run it after the step that produces that version" in message


def test_weight_delay_allows_stale_forward():
    """With weight_delay 1 the same order is fine: batch 1's forward uses version 0."""
    schedule = OrderSchedule(1, 1, num_batches=2, weight_delay=1)
    assert validate(program("stage 0: F0 B0 F1 Step B1 Step", schedule), collect=True) == []


def test_memory_bound():
    """validate(max_activations=N) rejects a stage holding more than N activations."""
    gpipe = schedcc.compile(schedcc.get_schedule("gpipe")(2, 4))
    with pytest.raises(MemoryBoundError) as info:
        validate(gpipe, max_activations=2)
    assert "stage 0, position 4 (F2) makes stage 0 hold 3 microbatch activations" in str(info.value)
    validate(gpipe, max_activations=4)
    one_f_one_b = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4), max_activations=2)
    with pytest.raises(MemoryBoundError):
        validate(one_f_one_b, max_activations=1)


def test_collect_returns_every_problem():
    """collect=True returns all problems, of several rules, instead of raising the first."""
    text = GPIPE_2_2.replace("RA0 F0 RA1 F1", "RA1 RA0 F1").replace("SG0 Step", "SG0")
    errors = validate(program(text), collect=True)
    assert {IncompleteScheduleError, DependencyError, UnmatchedCommError} <= kinds(errors)
    assert all(isinstance(error, ScheduleError) for error in errors)


def test_error_grid_marks_failing_row():
    """The error message ends with a grid whose `<-- here` row stars the failing instruction."""
    text = GPIPE_2_2.replace("RA0 F0 RA1 F1 B1 SG1 B0 SG0", "RA0 RA1 F1 B1 SG1 B0 SG0 F0")
    with pytest.raises(DependencyError) as info:
        validate(program(text))
    lines = str(info.value).splitlines()
    here = [line for line in lines if line.endswith("<-- here")]
    assert len(here) == 1
    assert here[0].split()[0] == "5"
    assert "*B0*" in here[0]
    assert any(line.startswith("pos") and "stage 1" in line for line in lines)


def test_render_grid_alone():
    """render_grid shows a window of positions and stages around the failing cell."""
    grid = render_grid(program(GPIPE_2_2), 0, 0)
    assert grid.splitlines()[1].startswith("0    *F0*")
    assert grid.splitlines()[1].endswith("<-- here")


DP_STAGE_0 = (
    "F0 SA0 F1 RG0 SA1 B0 RG1 B1 Reduce Step Gather F2 SA2 F3 RG2 SA3 B2 RG3 B3 Reduce Step Gather"
)


@pytest.mark.parametrize(
    ("old", "new", "says"),
    [
        ("RG1 B1 Reduce Step", "RG1 Step B1 Reduce", "is the step of batch 0, but only 1 of its 2"),
        ("B1 Reduce Step Gather F2", "B1 Step Gather F2", "steps before the gradients of chunk(s)"),
        ("F0 SA0 F1", "Reduce F0 SA0 F1", "has no gradient to reduce"),
        ("B1 Reduce Step Gather F2", "B1 Reduce Step F2", "its weights are stale"),
        ("RG1 B1 Reduce Step", "RG1 Reduce B1 Step", "adds a gradient after this batch's Reduce"),
    ],
)
def test_misplaced_updates_are_update_order_errors(old, new, says):
    """A step, reduction or ZeRO-1 gather out of place on a stage is an UpdateOrderError (a
    DependencyError) saying so."""
    good = schedcc.compile(
        schedcc.get_schedule("1f1b")(2, 2, num_batches=2), data_parallel=2, zero=1
    )
    assert " ".join(map(str, good.stages[0])) == DP_STAGE_0
    stage_0 = Program.parse_stages("stage 0: " + DP_STAGE_0.replace(old, new, 1))[0]
    bad = good.evolve(stages=(stage_0, good.stages[1]))
    problems = validate(bad, collect=True)
    assert any(type(p) is UpdateOrderError and says in str(p) for p in problems), problems
    assert all(isinstance(p, DependencyError) for p in problems if type(p) is UpdateOrderError)


def test_validate_rejects_what_is_not_a_program():
    """Passing a schedule instead of its compiled program is a config error that says so."""
    with pytest.raises(schedcc.ScheduleConfigError, match="compiled Program"):
        validate(schedcc.get_schedule("1f1b")(2, 2))


def test_a_forward_before_its_previous_segment_names_it_in_short_form():
    """On one stage with two chunks, F0.1 before F0 needs "F0 (the forward of segment 0)"."""
    schedule = schedcc.get_schedule("interleaved-1f1b")(1, 1, 2)
    bad = program("stage 0: F0.1 F0 B0.1 B0 Step", schedule)
    with pytest.raises(DependencyError, match=r"needs F0 \(the forward of segment 0\)"):
        validate(bad)


@pytest.mark.parametrize("limit", [0, -1, 2.5, True])
def test_max_activations_must_be_a_positive_integer(limit):
    """A memory bound that is not a positive integer is a config error, not a memory verdict."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    with pytest.raises(schedcc.ScheduleConfigError, match="max_activations must be a positive"):
        schedcc.validate(program, max_activations=limit)
