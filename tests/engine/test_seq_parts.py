"""Sequence parts: microbatches split along the sequence, whose forwards hand a carry on.

Seq1F1B with k = 2 and 4 parts trains a causal-attention GPT (its attention's keys and values
are the carry) to the numbers of non-pipelined training of the unsplit sequence, on the local
engine and on gloo; an order that runs a part's forward before its predecessor's, or its
backward before its successor's, is a `ScheduleError` naming the carry; and mutated programs are
refused or train exactly.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from _mutations import accepted, mutate, mutations
from _seq_models import gpt_segments, sgd, token_batches, token_loss, train_whole
from hypothesis import given, settings
from hypothesis import strategies as st

import schedcc
from schedcc import Backward, Forward, Schedule
from schedcc.backends.local import Engine as LocalEngine
from schedcc.backends.run.launch import spawn
from schedcc.backends.runtime.memory import measure_memory
from schedcc.cli import main
from schedcc.errors import (
    DependencyError,
    ScheduleConfigError,
    ScheduleError,
)
from schedcc.schedules.one_f_one_b import OneFOneB
from schedcc.schedules.seq1f1b import Seq1F1B
from schedcc.testing import check_schedule

TOLERANCE = 1e-10


def _train_local(program, batches) -> tuple[list[float], list[torch.nn.Module], LocalEngine]:
    segments = gpt_segments(program.schedule.num_segments, seed=3)
    engine = LocalEngine(program, segments, token_loss, sgd)
    return list(engine.train(batches)), segments, engine


def _assert_trains_whole(program, batches) -> None:
    """The local engine on `program` equals non-pipelined training of the unsplit sequences."""
    losses, segments, engine = _train_local(program, batches)
    oracle = gpt_segments(program.schedule.num_segments, seed=3)
    expected = train_whole(oracle, batches)
    assert max(abs(a - b) for a, b in zip(losses, expected)) < TOLERANCE, (losses, expected)
    with engine.unsharded():  # ZeRO-3 holds only shards between runs
        for got, want in zip(segments, oracle):
            for a, b in zip(got.parameters(), want.parameters()):
                assert torch.allclose(a, b, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize(
    ("p", "m", "parts", "num_batches"),
    [(2, 4, 2, 1), (2, 8, 4, 1), (3, 4, 2, 2), (4, 8, 4, 1)],
)
def test_seq1f1b_trains_a_causal_gpt_as_the_unsplit_sequence(p, m, parts, num_batches):
    """Seq1F1B over k parts equals training the whole sequences, losses and weights (1e-10)."""
    program = schedcc.compile(Seq1F1B(p, m, num_parts=parts, num_batches=num_batches))
    batches = token_batches(2 * num_batches, 2 * m // parts, seed=p + parts)
    _assert_trains_whole(program, batches)


def test_check_schedule_trains_seq1f1b_exactly_over_many_shapes():
    """`schedcc.testing.check_schedule(numerics=True)` proves, simulates and trains Seq1F1B
    (segments whose carry is a running sum) against the reference on the whole sequences."""
    check_schedule(Seq1F1B, numerics=True, max_examples=10)


def test_schedcc_show_draws_the_parts_and_refuses_1f1b_over_them(capsys):
    """`schedcc show -k K` draws each block with its part; 1F1B over parts is one error line
    naming the carry and exit status 2."""
    assert main(["show", "--schedule", "seq1f1b", "-p", "2", "-m", "8", "-k", "4"]) == 0
    out = capsys.readouterr().out
    assert "k=4 parts" in out
    assert "B3p3" in out
    assert main(["show", "--schedule", "1f1b", "-p", "2", "-m", "4", "-k", "2"]) == 2
    assert "gradient of its carry" in capsys.readouterr().err


@pytest.mark.parametrize(("data_parallel", "zero"), [(2, 0), (2, 1), (2, 3)])
def test_seq1f1b_with_data_parallelism_trains_as_the_unsplit_sequence(data_parallel, zero):
    """Under data parallelism and ZeRO the replicas' parts still equal the whole batch's
    training of the unsplit sequences (the local engine holds every replica)."""
    program = schedcc.compile(Seq1F1B(2, 4, num_parts=2), data_parallel=data_parallel, zero=zero)
    _assert_trains_whole(program, token_batches(2, 2 * 2 * data_parallel, seed=7))


def test_a_batch_splits_along_the_sequence_dim_of_the_schedule():
    """`seq_dim` picks the dim the parts cut: the same tokens laid out `(batch, 1, seq)` with
    `seq_dim=2` train to the numbers of the whole sequences."""

    class Squeezed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, carry=None):
            return self.inner(x[:, 0], carry)

    program = schedcc.compile(Seq1F1B(2, 4, num_parts=2, seq_dim=2))
    batches = token_batches(2, 4, seed=5)
    laid_out = [(x.unsqueeze(1), y.unsqueeze(1)) for x, y in batches]
    segments = gpt_segments(2, seed=3)
    wrapped = [Squeezed(segments[0]), segments[1]]

    def loss(output, target):
        return token_loss(output, target[:, 0])

    losses = list(LocalEngine(program, wrapped, loss, sgd).train(laid_out))
    expected = train_whole(gpt_segments(2, seed=3), batches)
    assert max(abs(a - b) for a, b in zip(losses, expected)) < TOLERANCE


def test_plain_1f1b_over_the_parts_is_refused_naming_the_carry():
    """1F1B over the same parts runs part 0's backward before part 1's: a DependencyError that
    names the carry's gradient (it would train wrong gradients)."""
    with pytest.raises(DependencyError, match="gradient of its carry") as caught:
        schedcc.compile(OneFOneB(2, 4, num_parts=2))
    assert "B1" in str(caught.value)
    assert "reverse" in str(caught.value)


class _ForwardsOutOfOrder(Schedule):
    """Part 1's forward before part 0's on every stage."""

    name = "forwards-out-of-order"

    def order(self, stage):
        yield from (Forward(1), Forward(0), Backward(1), Backward(0))


def test_a_part_forwarded_before_its_predecessor_is_refused_naming_the_carry():
    """F1 (part 1) before F0 (part 0) is a DependencyError naming the carry F1 consumes."""
    with pytest.raises(DependencyError, match="consumes the carry") as caught:
        schedcc.compile(_ForwardsOutOfOrder(2, 2, num_parts=2))
    assert "run F0 before it" in str(caught.value)


def test_the_same_order_without_parts_is_accepted():
    """The refusals come from the parts: the orders compile with num_parts=1 (the control)."""
    schedcc.compile(OneFOneB(2, 4))
    schedcc.compile(_ForwardsOutOfOrder(2, 2))


def test_parts_refuse_a_shape_recomputation_and_a_batch_they_cannot_split():
    """num_parts must divide m, recomputation is refused, a sequence dim the parts do not divide
    and a segment that does not return (output, carry) are typed errors naming the fix."""
    with pytest.raises(ScheduleConfigError, match="must divide num_microbatches"):
        Seq1F1B(2, 3, num_parts=2)
    with pytest.raises(ScheduleConfigError, match="without recompute"):
        schedcc.compile(Seq1F1B(2, 4), recompute=True)
    program = schedcc.compile(Seq1F1B(2, 4, num_parts=4))
    odd = [(x[:, :6], y[:, :6]) for x, y in token_batches(1, 2)]  # 6 tokens, 4 parts
    engine = LocalEngine(program, gpt_segments(2), token_loss, sgd)
    with pytest.raises(ScheduleConfigError, match="sequence parts along seq_dim=1"):
        list(engine.train(odd))

    class Plain(torch.nn.Module):
        def forward(self, x, carry=None):
            return x.double()

    engine = LocalEngine(schedcc.compile(Seq1F1B(1, 2)), [Plain()], token_loss, sgd)
    with pytest.raises(ScheduleConfigError, match=r"needs \(output, carry\) back"):
        list(engine.train(token_batches(1, 1)))


def test_seq1f1b_evaluates_as_the_unsplit_sequence():
    """A forward-only run hands the carry on too: `evaluate` equals the whole sequence's loss."""
    program = schedcc.compile(Seq1F1B(2, 4, num_parts=2))
    segments = gpt_segments(2, seed=4)
    inputs, targets = token_batches(1, 4, seed=9)[0]
    got = LocalEngine(program, segments, token_loss, sgd).evaluate(inputs, targets)
    x = inputs
    with torch.no_grad():
        for segment in gpt_segments(2, seed=4):
            x, _ = segment(x)
        want = token_loss(x, targets).item()
    assert abs(got - want) < TOLERANCE


def test_seq1f1b_beats_1f1b_over_the_same_data_in_simulation():
    """Simulated over the same data (m/k microbatches of whole sequences for 1F1B, m parts of
    half the cost for Seq1F1B at k = 2): Seq1F1B's makespan is shorter and stage 0's peak
    activations, counted in whole microbatches, lower."""
    p, m, k = 4, 8, 2
    seq = schedcc.simulate(
        schedcc.compile(Seq1F1B(p, m, num_parts=k)), schedcc.CostModel(forward=0.5, backward=1)
    )
    plain = schedcc.simulate(schedcc.compile(OneFOneB(p, m // k)))
    assert seq.makespan < plain.makespan
    assert max(seq.peak_activations) / k < max(plain.peak_activations)  # a part is 1/k of one


@pytest.mark.parametrize(("p", "m", "parts"), [(2, 4, 2), (2, 8, 4), (3, 4, 2)])
def test_measured_activation_bytes_equal_the_bytes_model_part_by_part(p, m, parts):
    """With a memory model measured part by part (a later part saves more: the carry it
    attends over), the simulator's peak activation bytes per stage are what the local engine
    measures; every part's count differs from the first part's, so equal sizes would not do."""
    program = schedcc.compile(Seq1F1B(p, m, num_parts=parts))
    batches = token_batches(1, 2 * m // parts, seed=2)
    x, y = batches[0]
    memory = measure_memory(gpt_segments(p), x[:2], y[:2], token_loss, num_parts=parts)
    assert all(len(set(row)) == parts for row in memory.part_activations)
    engine = LocalEngine(program, gpt_segments(p), token_loss, sgd)
    list(engine.train(batches))
    timeline = schedcc.simulate(program, schedcc.CostModel(memory=memory))
    assert list(timeline.peak_activation_bytes) == engine.peak_activation_bytes
    uniform = schedcc.simulate(
        program, schedcc.CostModel(memory=attrs.evolve(memory, part_activations=None))
    )
    assert list(uniform.peak_activation_bytes) != engine.peak_activation_bytes


def test_part_sizes_must_match_the_parts():
    """A memory model with part sizes for another number of parts is a ScheduleConfigError."""
    program = schedcc.compile(Seq1F1B(2, 4, num_parts=2))
    memory = schedcc.MemoryModel(activations=1, part_activations=[(1, 2, 3), (1, 2, 3)])
    with pytest.raises(ScheduleConfigError, match="has 2 parts: give one per part"):
        tuple(schedcc.simulate(program, schedcc.CostModel(memory=memory)).peak_activation_bytes)


# -- hypothesis: mutated programs ----------------------------------------------------------------


@given(st.integers(1, 3), st.sampled_from([2, 4]), st.integers(1, 2), mutations())
def test_a_mutated_seq1f1b_program_is_rejected_or_trains_exactly(p, parts, groups, edits):
    """A mutated Seq1F1B program raises a ScheduleError, or trains the whole sequences exactly."""
    program = schedcc.compile(Seq1F1B(p, parts * groups, num_parts=parts))
    mutated = program.evolve(stages=mutate(program.stages, edits, 1))
    if accepted(mutated):
        _assert_trains_whole(mutated, token_batches(2, 2 * groups, seed=parts))


@settings(max_examples=max(10, settings().max_examples // 2))
@given(st.integers(1, 3), st.sampled_from([2, 4]), st.permutations(range(4)))
def test_any_compute_order_of_the_parts_is_rejected_or_trains_exactly(p, parts, order):
    """A schedule yielding the parts' forwards and backwards in any order (the same on every
    stage) either fails to compile with a ScheduleError or trains exactly."""
    m = 4
    forwards, backwards = [Forward(i) for i in order], [Backward(i) for i in reversed(order)]

    class Any(Schedule):
        name = "any-order"

        def order(self, stage):
            yield from forwards
            yield from backwards

    try:
        program = schedcc.compile(Any(p, m, num_parts=parts))
    except ScheduleError:
        assert order != sorted(order)  # the parts' own order always compiles
        return
    _assert_trains_whole(program, token_batches(2, 2 * m // parts, seed=p))


# -- gloo ----------------------------------------------------------------------------------------


def _gloo_worker(rank: int, world_size: int) -> int:
    from _ranks import init

    from schedcc.backends.distributed.engine import Engine

    init(rank, world_size)
    for m, parts, p2p in ((4, 2, "shm"), (4, 2, "gloo"), (4, 2, "nccl"), (8, 4, "shm")):
        program = schedcc.compile(Seq1F1B(2, m, num_parts=parts))
        batches = token_batches(2, 2 * m // parts, seed=parts)
        segments = gpt_segments(2, seed=3)
        engine = Engine(program, segments, token_loss, sgd, timeout=60, p2p=p2p)
        losses = list(engine.train(batches))
        oracle = gpt_segments(2, seed=3)
        expected = train_whole(oracle, batches)
        where = (rank, m, parts, p2p)
        assert max(abs(a - b) for a, b in zip(losses, expected)) < TOLERANCE, where
        local, _, local_engine = _train_local(program, batches)
        assert max(abs(a - b) for a, b in zip(losses, local)) < 1e-12, where
        for a, b in zip(segments[rank].parameters(), oracle[rank].parameters()):
            assert torch.allclose(a, b, rtol=0, atol=TOLERANCE), where
        assert engine.evaluate(*batches[0]) == local_engine.evaluate(*batches[0]), where
    return 0


def test_seq1f1b_on_two_gloo_ranks_equals_the_unsplit_sequence():
    """Seq1F1B with 2 and 4 parts on 2 gloo ranks (shared memory, gloo point-to-point, NCCL's
    semantics emulated on gloo) equals the local engine (1e-12; evaluation exactly) and the whole
    sequences' training (1e-10), losses and each rank's weights."""
    assert spawn(_gloo_worker, 2, grace=90, threads=1) == 0
