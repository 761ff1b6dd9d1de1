"""The overlapped forward/backward pair (`F3.1 +B1`): printed and parsed, checked by its own rule,
lowered with its comm outside the pair, priced by `CostModel.overlap`, run in order, and read from
and written to torch's `OVERLAP_F_B` actions."""

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
    OverlapError,
    OverlappedBackward,
    Schedule,
    ScheduleConfigError,
    ScheduleError,
)
from schedcc.costs import overlapped_pair
from schedcc.ir import COMM, parse


class Written(Schedule):
    """A schedule whose stages yield the given orders (gpipe's looped placement)."""

    name = "written"

    def __init__(self, orders, num_microbatches):
        self.orders = [[parse(op) for op in order.split()] for order in orders]
        super().__init__(len(orders), num_microbatches)

    def order(self, stage):
        return iter(self.orders[stage])


def _compile(orders, m, **kwargs):
    return schedcc.compile(Written(orders, m), **kwargs)


@pytest.mark.parametrize("text", ["+B1", "+B3.2", "+B0"])
def test_printed_form_round_trips(text):
    """`+B1` is an overlapped backward, and `parse` inverts `str` exactly."""
    op = parse(text)
    assert type(op) is OverlappedBackward
    assert str(op) == text
    assert op != parse(text[1:])  # not a plain backward


def test_a_pair_on_one_stage_is_priced_by_the_overlap_fraction():
    """F0 F1 +B0 B1 on one stage takes F + (max(F, B) + overlap * min(F, B)) + B."""
    program = _compile(["F0 F1 +B0 B1"], 2)
    assert schedcc.simulate(program).makespan == 1 + 2.5 + 2
    assert schedcc.simulate(program, CostModel(overlap=0.0)).makespan == 1 + 2 + 2
    assert schedcc.simulate(program, CostModel(overlap=1.0)).makespan == 1 + 3 + 2
    slow = CostModel(forward=3.0, backward=2.0, overlap=0.25)
    assert overlapped_pair(slow) == 3.5
    assert schedcc.simulate(program, slow).makespan == 3 + 3.5 + 2
    assert schedcc.simulate(program, slow, eager=True).makespan == 3 + 3.5 + 2


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "half"])
def test_the_overlap_fraction_is_checked(bad):
    """`CostModel(overlap=...)` is a fraction in [0, 1]; anything else is a config error."""
    with pytest.raises(ScheduleConfigError, match="overlap"):
        CostModel(overlap=bad)


@pytest.mark.parametrize(
    ("orders", "match"),
    [
        (["F0 +B0 F1 B1"], "needs what F0 makes"),  # a backward on its own forward's output
        (["F0 SA0 F1 RG0 +B0 SA1 RG1 B1", "RA0 F0 B0 SG0 RA1 F1 B1 SG1"], "RG0 is there"),
        (["F0 F1 B1 +B0"], "B1 is there"),
    ],
)
def test_a_backward_without_a_forward_to_overlap_is_refused(orders, match):
    """An overlapped backward directly follows an independent forward, or compile says so."""
    with pytest.raises(OverlapError, match=match):
        _compile(orders, 2)


def test_the_compiler_keeps_comm_outside_each_pair():
    """Across stages the pair's receives go before the forward and its sends after the backward:
    nothing sits between the two."""
    orders = ["F0 F1 F2 +B0 F3 +B1 B2 B3", "F0 F1 +B0 F2 +B1 F3 +B2 B3"]
    program = _compile(orders, 4)
    for ops in program.stages:
        for pos, op in enumerate(ops):
            if type(op) is OverlappedBackward:
                assert type(ops[pos - 1]) is Forward, program.to_text()
    assert any(type(op) in COMM for op in program.stages[0])
    # each pair's price is on the critical path (stage 1 waits for stage 0's pair to end)
    spans = [schedcc.simulate(program, CostModel(overlap=f)).makespan for f in (0.0, 0.5, 1.0)]
    assert spans[0] < spans[1] < spans[2]
    assert spans[2] - spans[1] == spans[1] - spans[0]


def test_pairs_train_like_non_pipelined():
    """The runtime runs a pair as its forward then its backward: exact in float64."""
    pytest.importorskip("torch")
    from _models import batches, make_segments, mse, sgd

    from schedcc.backends.reference import assert_matches_reference

    program = _compile(["F0 F1 F2 +B0 F3 +B1 B2 B3", "F0 F1 +B0 F2 +B1 F3 +B2 B3"], 4)
    data = batches(2, 4)
    assert assert_matches_reference(program, make_segments(2), mse, sgd, data) < 1e-10


def test_torch_overlap_actions_round_trip():
    """A pair exports as torch's `(aFi;bBj)OVERLAP_F_B` and imports back as the same pair."""
    pytest.importorskip("torch")
    from schedcc.interop.torch import from_torch_actions, to_torch_actions

    program = _compile(["F0 F1 +B0 B1", "F0 B0 F1 B1"], 2)
    rows = to_torch_actions(program, comms=False)
    assert rows[0] == ["0F0", "(0F1;0B0)OVERLAP_F_B", "0B1"]
    back = from_torch_actions(rows, 2)
    assert list(back.order(0)) == list(program.schedule.order(0))


@given(schedule=random_orders(max_stages=4, max_microbatches=6), data=st.data())
def test_random_orders_with_pairs_validate_or_are_refused_and_train_exactly(schedule, data):
    """Any dependency-respecting order with some plain backwards made overlapped with the forward
    right before them either compiles (then it trains exactly like non-pipelined training, and the
    eager timeline is no slower than the rendezvous one) or is refused with a `ScheduleError`
    (pairing a forward with a backward that waits for it can close a cycle), never anything else."""
    pytest.importorskip("torch")
    from _models import batches, make_segments, mse, sgd

    from schedcc.backends.reference import assert_matches_reference

    paired = []
    for ops in schedule.orders:
        ops = list(ops)
        for pos in range(1, len(ops)):
            before, op = ops[pos - 1], ops[pos]
            eligible = type(op) is Backward and type(before) is Forward
            own = (before.microbatch, before.chunk) == (op.microbatch, op.chunk)
            if eligible and not own and data.draw(st.integers(0, 3)):  # 3 in 4 paired
                ops[pos] = OverlappedBackward(op.microbatch, op.chunk)
        paired.append(ops)
    schedule.orders = paired
    try:
        program = schedcc.compile(schedule)
    except ScheduleError:
        return
    assert schedcc.simulate(program, eager=True).makespan <= schedcc.simulate(program).makespan
    segments = make_segments(schedule.num_segments)
    data_ = batches(schedule.num_batches, schedule.num_microbatches)
    assert assert_matches_reference(program, segments, mse, sgd, data_) < 1e-10
