"""Tied parameters under a weight delay (2BW-like orders): where the members of a tie can
meet only after one has run work of the next batch, its step waits for the collective (that
batch's forward and input gradient run on the older weights anyway), and comm that insert_comm
placed for speed moves so that no work needing the step comes first. Such programs compile and
train exactly; the rest are refused with a ScheduleConfigError, never compiled into a
deadlock."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _orders import OrderSchedule, random_orders
from _tied_models import adam, batches, mse, tied_segments
from hypothesis import given
from hypothesis import strategies as st
from test_tied_training import _train_and_compare

import schedcc
from schedcc.backends.distributed.engine import Engine as DistributedEngine
from schedcc.backends.local import Engine
from schedcc.backends.run.launch import spawn
from schedcc.errors import ScheduleConfigError
from schedcc.ir import parse


def _order(text: str) -> list:
    return [parse(x) for x in text.split()]


def _moved_comm_program():
    """Stage 1 sends SG0 after W1 unless tied; tied, SG0 follows SG1 and W1 the step."""
    schedule = OrderSchedule(2, 1, 1, 2, weight_delay=1)
    schedule.orders = [_order("F0 F1 I1 I0 W0 W1"), _order("F0 F1 I0 W0 I1 W1")]
    return schedule


def _train_exactly(program) -> None:
    """The local engine on the tied model equals non-pipelined training to 1e-10 (with data
    parallelism, on the whole batch, which the engine splits over its replicas), and so does
    every stage's copy of the tied weight."""
    schedule = program.schedule
    m = schedule.num_microbatches
    data = batches(schedule.num_batches, 2 * m * program.data_parallel)
    _train_and_compare(program, tied_segments(schedule.num_segments), data)


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


def test_comm_placed_for_speed_moves_so_that_the_tie_fits():
    """Stage 0 takes I1's gradient before I0's, so stage 1 sends SG0 after SG1, which
    insert_comm put after W1: batch 0's tie would need W1, which needs the step of batch 0.
    With the tie, SG0 goes right after SG1 and W1 after the step; it trains exactly."""
    schedule = _moved_comm_program()
    assert schedcc.compile(schedule).to_text().splitlines()[1] == (
        "stage 1: RA0 F0 RA1 F1 I0 W0 Step I1 SG1 W1 SG0 Step"
    )
    program = schedcc.compile(schedule, tied=[(0, 1)])
    assert program.to_text().splitlines()[1] == (
        "stage 1: RA0 F0 RA1 F1 I0 W0 I1 SG1 SG0 Tied0 Step W1 Tied0 Step"
    )
    _train_exactly(program)


def _distributed_worker(rank: int, world_size: int) -> int:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    program = schedcc.compile(_moved_comm_program(), tied=[(0, 1)])
    segments = tied_segments(2)
    local = copy.deepcopy(segments)
    data = batches(4, 2)
    losses = list(DistributedEngine(program, segments, mse, adam, timeout=60).train(data))
    expected = list(Engine(program, local, mse, adam).train(data))
    assert losses == expected, (rank, losses, expected)
    for got, want in zip(segments[rank].parameters(), local[rank].parameters()):
        assert torch.equal(got, want), rank
    return 0


def test_the_moved_comm_program_on_two_gloo_ranks_equals_the_local_engine():
    """The tied program whose comm moved runs on two gloo ranks to the local engine's numbers
    (losses and each rank's weights, bitwise)."""
    assert spawn(_distributed_worker, 2, grace=60, threads=1) == 0


def test_a_later_batchs_comm_moves_after_the_last_weight_gradient():
    """Stage 0 receives batch 1's RG2 before its last backward of batch 0 (B1), and stage 1
    sends it after B2, which needs stage 1's step of batch 0: RG2 goes after B1 and the tie
    (only stage 0's B2 needs it)."""
    schedule = OrderSchedule(2, 2, 1, 2, weight_delay=1)
    schedule.orders = [_order("F2 F3 F1 F0 B0 B1 B2 B3"), _order("F2 F1 B1 F0 B0 B2 F3 B3")]
    assert "RG2 B1 Step" in schedcc.compile(schedule).to_text()
    program = schedcc.compile(schedule, tied=[(0, 1)])
    assert "B1 Tied0 RG2 Step" in program.to_text()
    _train_exactly(program)


def test_a_tie_without_a_placement_found_is_refused():
    """Where no move lets every member reach its tie before its step, the compiler refuses
    with a ScheduleConfigError naming the work that needs the step (here stage 2's B5)."""
    schedule = OrderSchedule(3, 3, 1, 2, weight_delay=1)
    schedule.orders = [
        _order("F5 F1 F2 F4 F0 B2 F3 B0 B1 B5 B4 B3"),
        _order("F1 F5 F2 B1 F0 F4 B2 B0 B5 F3 B4 B3"),
        _order("F1 B1 F5 F2 F0 B2 F4 B0 B5 B4 F3 B3"),
    ]
    schedcc.compile(schedule)  # untied, it runs
    with pytest.raises(ScheduleConfigError, match=r"stage 2 must run B5 .* no ReduceTied fits"):
        schedcc.compile(schedule, tied=[(0, 2)])


@given(
    st.sampled_from([0, 1, 2]).flatmap(
        lambda d: random_orders(weight_delay=d, max_stages=3, max_microbatches=3, max_chunks=2)
    ),
    st.sampled_from([(1, 0), (2, 0), (2, 2)]),
)
def test_random_orders_with_a_tie_train_exactly_or_are_refused(schedule: OrderSchedule, dp_zero):
    """Random dependency-respecting orders, with and without a weight delay, first and last
    segment tied, with data parallelism and ZeRO-2 or not: they compile and train exactly, or
    are refused with a ScheduleConfigError (never a DeadlockError from compile)."""
    n = schedule.num_segments
    if n < 2:
        return
    dp, zero = dp_zero
    try:
        program = schedcc.compile(schedule, tied=[(0, n - 1)], data_parallel=dp, zero=zero)
    except ScheduleConfigError as error:
        refusal = str(error)
    else:
        _train_exactly(program)
        return
    assert schedule.weight_delay > 0
    assert "no ReduceTied fits" in refusal
