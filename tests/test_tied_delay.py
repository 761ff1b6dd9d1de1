"""Tied parameters under a weight delay (2BW-like orders): where every member of a tie can
reach its `ReduceTied` only after another has run work of the next batch, the step waits for
the collective (the later batch's forward and input gradient run on the older weights anyway);
such programs compile and train exactly, and the rest are refused with a ScheduleConfigError,
never compiled into a deadlock."""

from __future__ import annotations

import copy

import pytest
import torch
from _orders import OrderSchedule, random_orders
from _tied_models import adam, batches, mse, tied_segments
from hypothesis import given
from hypothesis import strategies as st

import schedcc
from schedcc.backends.local import Engine
from schedcc.backends.reference import train_reference
from schedcc.errors import ScheduleConfigError
from schedcc.ir import parse


def _order(text: str) -> list:
    return [parse(x) for x in text.split()]


def _train_exactly(program) -> None:
    """The local engine on the tied model equals non-pipelined training to 1e-10."""
    schedule = program.schedule
    n, m = schedule.num_segments, schedule.num_microbatches
    segments = tied_segments(n)
    piped, plain = copy.deepcopy(segments), copy.deepcopy(segments)
    data = batches(schedule.num_batches, 2 * m)
    losses = list(Engine(program, piped, mse, adam).train(data))
    expected = train_reference(
        plain,
        mse,
        adam,
        data,
        weight_delay=schedule.weight_delay,
        batches_per_run=schedule.num_batches,
    )
    assert losses == pytest.approx(expected, abs=1e-10, rel=1e-10)
    for mine, theirs in zip(piped, plain):
        for p, q in zip(mine.parameters(), theirs.parameters()):
            assert torch.allclose(p, q, atol=1e-10, rtol=1e-10)


def test_the_step_waits_for_a_tie_that_needs_the_next_batch():
    """Stage 0 runs both input gradients before its first weight gradient; stage 1 runs batch
    1's forward and input gradient after batch 0's weight gradient. Stage 0's tie needs stage
    1's SG1, so stage 1 sums and steps batch 0 after I1 SG1 (F1 and I1 use version 0 either
    way), not right after W0: a deadlock otherwise."""
    schedule = OrderSchedule(2, 1, 1, 2, weight_delay=1)
    schedule.orders = [_order("F0 F1 I0 I1 W0 W1"), _order("F0 I0 W0 F1 I1 W1")]
    program = schedcc.compile(schedule, tied=[(0, 1)])
    assert program.to_text().splitlines()[1] == (
        "stage 1: RA0 F0 I0 SG0 W0 RA1 F1 I1 SG1 Tied0 Step W1 Tied0 Step"
    )
    _train_exactly(program)


def test_a_tie_that_needs_a_later_weight_gradient_is_refused():
    """Stage 1 sends batch 0's input gradient only after W1 (stage 0 takes I1's first): the
    tie of batch 0 needs W1, which must follow the step of batch 0, so no placement exists
    without reordering the sends; refused with a ScheduleConfigError naming W1."""
    schedule = OrderSchedule(2, 1, 1, 2, weight_delay=1)
    schedule.orders = [_order("F0 F1 I1 I0 W0 W1"), _order("F0 F1 I0 W0 I1 W1")]
    schedcc.compile(schedule)  # untied, it runs
    with pytest.raises(ScheduleConfigError, match=r"stage 1 must run W1"):
        schedcc.compile(schedule, tied=[(0, 1)])


@given(
    st.sampled_from([0, 1, 2]).flatmap(
        lambda d: random_orders(weight_delay=d, max_stages=3, max_microbatches=3, max_chunks=2)
    )
)
def test_random_orders_with_a_tie_train_exactly_or_are_refused(schedule: OrderSchedule):
    """Random dependency-respecting orders, with and without a weight delay, first and last
    segment tied: they compile and train exactly, or are refused with a ScheduleConfigError
    (never a DeadlockError from compile)."""
    n = schedule.num_segments
    if n < 2:
        return
    try:
        program = schedcc.compile(schedule, tied=[(0, n - 1)])
    except ScheduleConfigError as error:
        refusal = str(error)
    else:
        _train_exactly(program)
        return
    assert schedule.weight_delay > 0
    assert "no ReduceTied fits" in refusal
