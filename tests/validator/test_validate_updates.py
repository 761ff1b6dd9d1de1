"""The validator's update-instruction rules: a program whose
Reduce, Step or Gather would train wrong numbers or crash mid-step is refused before it runs.

Each program below is hand-written (the schedule yields every instruction, so the compiler
inserts none) on GPipe's shape p=2, m=1 unless said otherwise.
"""

from __future__ import annotations

import re

import pytest
from _orders import OrderSchedule

import schedcc
from schedcc import (
    Backward,
    DependencyError,
    Forward,
    Program,
    Schedule,
    ScheduleError,
    WeightVersionError,
    validate,
)
from schedcc.errors import UpdateOrderError
from schedcc.ir import parse


class Written(Schedule):
    """Yields the instructions of `texts[stage]` (`"F0 SA0 RG0 B0 Step"`), in order."""

    name = "written"
    texts: tuple[str, ...] = ()

    def order(self, stage: int):
        return [parse(token) for token in self.texts[stage].split()]


def written(*texts: str, num_microbatches: int = 1, num_batches: int = 1) -> Written:
    cls = type("Written", (Written,), {"texts": texts})
    return cls(len(texts), num_microbatches, num_batches=num_batches)


#: Class A: stage 0's comm group [RG0 SA0] is posted whole (rendezvous): valid.
CLASS_A = ("F0 RG0 SA0 B0 Step", "RA0 F0 B0 SG0 Step")
#: Class B (zero=1): stage 0 gathers before its step, so its step is never gathered.
CLASS_B = ("F0 SA0 RG0 B0 Reduce Gather Step", "RA0 F0 B0 SG0 Reduce Step Gather")
#: Class C (zero=0): a Gather without ZeRO (it raised mid-run, after the Step changed weights).
CLASS_C = ("F0 SA0 RG0 B0 Step Gather", "RA0 F0 B0 SG0 Step")
#: Class D (zero=1): a Gather between F0 and B0 rewrites the weights B0's graph holds.
CLASS_D = ("F0 SA0 RG0 B0 Reduce Step Gather", "RA0 F0 Gather B0 SG0 Reduce Step Gather")


def test_class_a_rendezvous_group_is_accepted():
    """Class A is valid under the rendezvous semantics: a group's send is posted together with
    its receive."""
    program = schedcc.compile(written(*CLASS_A))
    assert program.to_text() == "stage 0: F0 RG0 SA0 B0 Step\nstage 1: RA0 F0 B0 SG0 Step"
    assert validate(program, collect=True) == []


@pytest.mark.parametrize(
    ("texts", "zero", "error", "says"),
    [
        (CLASS_B, 1, UpdateOrderError, "GatherParams of chunk(s) [0] never follows it"),
        (CLASS_C, 0, UpdateOrderError, "the program has no ZeRO (zero=0)"),
        (CLASS_D, 1, WeightVersionError, "changes the weights of chunk 0 between F0 and its"),
    ],
    ids=["B", "C", "D"],
)
def test_misplaced_updates_are_refused(texts, zero, error, says):
    """Three misplaced-update programs (B: a Gather before its chunk's Step; C: a Gather
    without ZeRO; D: a Gather between a forward and its backward) are refused by compile with the
    rule's own error, naming what to change."""
    with pytest.raises(error, match=re.escape(says)) as info:
        schedcc.compile(written(*texts), zero=zero)
    assert isinstance(info.value, ScheduleError)
    assert "<-- here" in str(info.value)


def test_the_same_programs_in_order_are_accepted():
    """Each class with its updates where the compiler puts them compiles (the rules are tight)."""
    fixed = ("F0 SA0 RG0 B0 Reduce Step Gather", "RA0 F0 B0 SG0 Reduce Step Gather")
    assert (
        schedcc.compile(written(*fixed), zero=1).stages
        == schedcc.compile(schedcc.get_schedule("gpipe")(2, 1), zero=1).stages
    )
    schedcc.compile(written("F0 SA0 RG0 B0 Step", "RA0 F0 B0 SG0 Step"), zero=0)


@pytest.mark.parametrize(
    ("texts", "dp", "zero", "error", "says"),
    [
        (  # data parallel: the step comes before the chunk's gradients are reduced
            ("F0 SA0 RG0 B0 Step", "RA0 F0 B0 SG0 Reduce Step"),
            2,
            0,
            UpdateOrderError,
            r"steps before the gradients of chunk\(s\) \[0\] are reduced",
        ),
        (  # reduced twice in one batch: the second has nothing to reduce
            ("F0 SA0 RG0 B0 Reduce Reduce Step", "RA0 F0 B0 SG0 Reduce Step"),
            2,
            0,
            UpdateOrderError,
            "has no gradient to reduce",
        ),
        (  # ZeRO: a gather missing after the step on stage 1
            ("F0 SA0 RG0 B0 Reduce Step Gather", "RA0 F0 B0 SG0 Reduce Step"),
            1,
            1,
            UpdateOrderError,
            r"GatherParams of chunk\(s\) \[0\] never follows it",
        ),
        (  # a step between a forward and its backward
            ("F0 SA0 RG0 Step B0", "RA0 F0 B0 SG0 Step"),
            1,
            0,
            UpdateOrderError,
            "is the step of batch 0, but only 0 of its 1 weight gradients",
        ),
        (  # ZeRO-2 still needs the gather after the step
            ("F0 SA0 RG0 B0 Reduce Step", "RA0 F0 B0 SG0 Reduce Step Gather"),
            1,
            2,
            UpdateOrderError,
            "never follows it",
        ),
    ],
    ids=["reduce-missing", "reduce-twice", "gather-missing", "step-inside", "zero-2-gather"],
)
def test_update_rule_grid(texts, dp, zero, error, says):
    """Each update rule refuses its case with its own typed error (all DependencyError or
    WeightVersionError subclasses of ScheduleError), at compile time."""
    with pytest.raises(error, match=says):
        schedcc.compile(written(*texts), data_parallel=dp, zero=zero)


def test_update_window_is_open_under_a_weight_delay():
    """With weight_delay 1 (2BW) a forward runs on a stashed copy: a step and a gather between
    a forward and its backward are fine; with no delay the same place is refused."""
    order = [[Forward(0), Backward(0), Forward(1), Backward(1)]]
    delayed = OrderSchedule(1, 1, num_batches=2, weight_delay=1, orders=order)
    good = schedcc.compile(delayed, zero=1)
    stage = Program.parse_stages("stage 0: F0 B0 F1 Reduce Step Gather B1 Reduce Step Gather")
    moved = good.evolve(stages=stage)
    assert validate(moved, collect=True) == []
    flush = OrderSchedule(1, 1, num_batches=2, orders=order)
    refused = validate(Program(flush, stage, zero=1), collect=True)
    assert any(type(e) is WeightVersionError and "between F1 and" in str(e) for e in refused)


def test_a_gather_of_another_chunk_inside_a_window_is_fine():
    """The window rule is per chunk: Gather(1) between F0 and B0 on chunk 0 leaves chunk 0's
    weights alone, while Gather(0) there is refused."""
    schedule = schedcc.get_schedule("interleaved-1f1b")(1, 1, 2)
    ok = "stage 0: F0 F0.1 B0.1 Gather.1 B0 Reduce Reduce.1 Step Gather Gather.1"
    bad = ok.replace("B0.1 Gather.1 B0", "B0.1 Gather B0")
    assert not [
        e
        for e in validate(Program(schedule, Program.parse_stages(ok), zero=1), collect=True)
        if type(e) is WeightVersionError
    ]
    with pytest.raises(WeightVersionError, match="changes the weights of chunk 0 between F0"):
        validate(Program(schedule, Program.parse_stages(bad), zero=1))


def test_one_program_per_stage_for_every_replica():
    """A program holds one instruction list per stage, run by each data-parallel replica; a
    program with another number of lists is refused (not an IndexError)."""
    schedule = schedcc.get_schedule("gpipe")(2, 1)
    good = schedcc.compile(schedule, data_parallel=2)
    extra = good.evolve(stages=(*good.stages, good.stages[1]))
    with pytest.raises(UpdateOrderError, match="3 stage program"):
        validate(extra)
    assert len(validate(extra, collect=True)) == 1


def test_update_order_error_is_a_dependency_error():
    """UpdateOrderError is a DependencyError (what these problems raised before)."""
    assert issubclass(UpdateOrderError, DependencyError)
    assert schedcc.UpdateOrderError is UpdateOrderError
