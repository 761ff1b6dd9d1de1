"""Recomputation: the `Recompute` instruction, `compile(recompute=...)` and what they cost.

A forward whose stage also runs `R` of it keeps only its input; `R` rebuilds its graph (on the
same RNG state) before the backward. Training is unchanged, the measured activation bytes go
down, and the simulated time goes up by the recompute's cost.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _models import batches, make_segments, mse, sgd
from _mutations import accepted, mutate, mutations, trains_exactly
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import schedcc
from schedcc import Backward, Forward, Recompute, RecomputeError, Schedule, ScheduleError
from schedcc.backends.local import Engine
from schedcc.backends.reference import assert_matches_reference
from schedcc.errors import ScheduleConfigError
from schedcc.ir import parse
from schedcc.semantics import peak_activations
from schedcc.testing import Shape

FULL = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)]


def _train(program, segments, data):
    engine = Engine(program, segments, mse, sgd)
    losses = list(engine.train(data))
    return engine, losses


def test_recompute_prints_and_parses():
    """`R3` / `R3.1` is a recompute of microbatch 3 on chunk 0 / 1, and `parse` inverts it."""
    assert str(Recompute(3)) == "R3"
    assert str(Recompute(3, chunk=1)) == "R3.1"
    assert parse("R3.1") == Recompute(3, 1)
    assert parse("R3") == Recompute(3)
    assert parse("RA3") != Recompute(3)


@pytest.mark.parametrize(("name", "v"), FULL)
def test_full_recompute_trains_exactly_holds_less_and_takes_longer(name, v):
    """`compile(s, recompute=True)` trains like non-pipelined training, with fewer measured
    activation bytes and a longer simulated makespan than without recomputation."""
    p, m = 2, 4
    schedule = schedcc.get_schedule(name)(p, m, v)
    plain = schedcc.compile(schedule)
    program = schedcc.compile(schedule, recompute=True)
    assert {type(op) for op in program.stages[0]} >= {Recompute}
    data = batches(2, 2 * m)
    assert_matches_reference(program, make_segments(p * v), mse, sgd, data)
    with_r, _ = _train(program, make_segments(p * v), data)
    without, _ = _train(plain, make_segments(p * v), data)
    assert sum(with_r.peak_activation_bytes) < sum(without.peak_activation_bytes)
    assert with_r.peak_activation_bytes[0] < without.peak_activation_bytes[0]
    assert schedcc.simulate(program).makespan > schedcc.simulate(plain).makespan
    assert schedcc.simulate(program).peak_activations[0] == 1


def test_full_recompute_places_r_before_each_first_backward_piece():
    """Every microbatch on every chunk gets one `R`, right before its `B` (or its `I`)."""
    program = schedcc.compile(schedcc.get_schedule("zb-h1")(2, 3), recompute=True)
    for ops in program.stages:
        computes = [op for op in ops if op.group == "compute"]
        for pos, op in enumerate(computes):
            if type(op) is Recompute:
                nxt = computes[pos + 1]
                assert (nxt.code, nxt.microbatch, nxt.chunk) == ("I", op.microbatch, op.chunk)
        assert sum(type(op) is Recompute for op in ops) == 3


class _RecomputeEarly(Schedule):
    """GPipe that recomputes every odd microbatch in the bubble before its gradient arrives."""

    name = "recompute-early"

    def order(self, stage):
        mbs = self.microbatches(0)
        for i in mbs:
            yield Forward(i)
        for i in reversed(mbs):
            if i % 2:
                yield Recompute(i)
        for i in reversed(mbs):
            yield Backward(i)


def test_a_schedule_that_places_its_own_recompute_trains_exactly():
    """A hand-written schedule yielding `R` trains like non-pipelined training; only the
    recomputed microbatches are held from their `R`."""
    schedule = _RecomputeEarly(2, 4)
    program = schedcc.compile(schedule)
    assert_matches_reference(program, make_segments(2), mse, sgd, batches(2, 8))
    assert schedcc.simulate(program).peak_activations == (4, 4)
    computes = [op for op in program.stages[0] if op.group == "compute"]
    counted = [str(op) for op in computes]
    assert counted[:6] == ["F0", "F1", "F2", "F3", "R3", "R1"]
    again = schedcc.compile(schedule, recompute=True)  # its own Rs stay, the others are added
    assert sum(type(op) is Recompute for op in again.stages[0]) == 4


def _written(order: str) -> type[Schedule]:
    class Written(Schedule):
        name = "written"

        def order(self, stage):
            for word in order.split():
                yield parse(word)

    return Written


@pytest.mark.parametrize(
    ("order", "what"),
    [
        ("R0 F0 B0", "before its forward"),
        ("F0 B0 R0", "after its backward began"),
        ("F0 R0 R0 B0", "a second time"),
    ],
)
def test_a_misplaced_recompute_is_a_schedule_error(order, what):
    """`R` before its `F`, after its backward, or twice is a `RecomputeError`."""
    with pytest.raises(RecomputeError, match=what) as info:
        schedcc.compile(_written(order)(2, 1))
    assert isinstance(info.value, ScheduleError)
    assert "<-- here" in str(info.value)


def test_recompute_after_the_input_gradient_is_refused():
    """With a split backward, `R` after `I` is too late (`W` needs `I`'s graph)."""
    with pytest.raises(RecomputeError, match="after its backward began"):
        schedcc.compile(_written("F0 I0 R0 W0")(2, 1))


def test_the_memory_rule_counts_from_r():
    """`max_activations` counts a recomputed microbatch from its `R`, not its `F`."""
    schedule = schedcc.get_schedule("gpipe")(2, 4)
    with pytest.raises(schedcc.MemoryBoundError):
        schedcc.compile(schedule, max_activations=1)
    schedcc.compile(schedule, recompute=True, max_activations=1)
    ops = [parse(op) for op in ["F0", "F1", "R1", "B1", "F2", "R0", "B0", "B2"]]
    assert peak_activations(ops) == 2  # F2 is not recomputed: held from F2, with R0


def test_recompute_policies_pick_stages_and_chunks():
    """A set of stages, of (stage, chunk) pairs, or a callable picks where `R` goes."""
    schedule = schedcc.get_schedule("interleaved-1f1b")(2, 4, 2)

    def where(program):
        return {
            (s, op.chunk)
            for s, ops in enumerate(program.stages)
            for op in ops
            if type(op) is Recompute
        }

    assert where(schedcc.compile(schedule, recompute={1})) == {(1, 0), (1, 1)}
    assert where(schedcc.compile(schedule, recompute={(0, 1)})) == {(0, 1)}
    chunk_zero = schedcc.compile(schedule, recompute=lambda stage, chunk: chunk == 0)
    assert where(chunk_zero) == {(0, 0), (1, 0)}
    assert where(schedcc.compile(schedule, recompute=False)) == set()
    for bad in ({5}, {(0, 2)}, "all", 3, lambda s, c: "yes"):
        with pytest.raises(ScheduleConfigError, match="recompute"):
            schedcc.compile(schedule, recompute=bad)


def test_over_limit_recomputes_only_the_stages_that_need_it():
    """`OverLimit(n)` recomputes the stages that would hold more than n activations; the program
    then fits `max_activations=n` and trains exactly."""
    from schedcc.passes.insert_recompute import OverLimit

    schedule = schedcc.get_schedule("1f1b")(4, 8)
    program = schedcc.compile(schedule, recompute=OverLimit(2), max_activations=2)
    recomputing = {
        s for s, ops in enumerate(program.stages) if any(type(op) is Recompute for op in ops)
    }
    assert recomputing == {0, 1}
    assert schedcc.simulate(program).peak_activations == (1, 1, 2, 1)
    assert_matches_reference(program, make_segments(4), mse, sgd, batches(1, 16))
    with pytest.raises(ScheduleConfigError, match="positive integer"):
        OverLimit(0)


def test_recompute_cost_defaults_to_the_forward_cost():
    """`CostModel(recompute=None)` prices an `R` like an `F`; a given cost is used as is."""
    program = schedcc.compile(schedcc.get_schedule("gpipe")(1, 2), recompute=True)
    assert schedcc.simulate(program).makespan == 2 + 2 + 2 * 2
    assert schedcc.simulate(program, schedcc.CostModel(forward=3.0)).makespan == 6 + 6 + 4
    assert schedcc.simulate(program, schedcc.CostModel(recompute=0.5)).makespan == 2 + 1 + 4
    with pytest.raises(ScheduleConfigError):
        schedcc.CostModel(recompute=-1.0)


def _dropout_segments(n: int) -> list[nn.Module]:
    out = []
    for seg in make_segments(n, width=6):
        out.append(nn.Sequential(*seg, nn.Dropout(0.5)))
    return out


def test_recompute_reproduces_dropout_masks():
    """With dropout, pipelined training with and without recomputation gives identical
    parameters (the recompute replays its forward's RNG state, and leaves the stream as it was)."""
    schedule = schedcc.get_schedule("1f1b")(2, 4)
    segments = _dropout_segments(2)
    data = batches(3, 8, width=6)
    runs = []
    for recompute in (False, True):
        copies = copy.deepcopy(segments)
        torch.manual_seed(7)
        program = schedcc.compile(schedule, recompute=recompute)
        losses = list(Engine(program, copies, mse, sgd).train(data))
        runs.append((losses, [p.detach().clone() for seg in copies for p in seg.parameters()]))
        after = torch.rand(1)  # what the RNG stream gives next
        runs[-1] += (after,)
    (losses0, params0, next0), (losses1, params1, next1) = runs
    assert losses0 == losses1
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))
    assert torch.equal(next0, next1)
    untouched = [p for seg in segments for p in seg.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(params0, untouched))


@given(
    name=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "2bw"]),
    p=st.integers(1, 3),
    m=st.integers(1, 4),
    num_batches=st.integers(1, 2),
)
def test_full_recompute_of_any_builtin_shape_validates_simulates_and_trains(
    name, p, m, num_batches
):
    """A random built-in shape with `recompute=True` compiles, validates, simulates (no less
    time than without) and trains like non-pipelined training on the local backend."""
    cls = schedcc.get_schedule(name)
    v = 2 if name in ("interleaved-1f1b", "zb-v") else 1
    shape = Shape(p, m, v, num_batches)
    if not shape.accepted_by(cls):
        return
    schedule = shape.build(cls)
    program = schedcc.compile(schedule, recompute=True)
    schedcc.validate(program)
    assert (
        schedcc.simulate(program).makespan >= schedcc.simulate(schedcc.compile(schedule)).makespan
    )
    runs = 2 * schedule.num_batches if schedule.weight_delay else schedule.num_batches
    assert_matches_reference(program, make_segments(p * v), mse, sgd, batches(runs, 2 * m))


def _distributed_worker(rank: int, world_size: int) -> int:
    from datetime import timedelta

    import torch.distributed as dist

    from schedcc.backends.distributed.engine import Engine as DistributedEngine
    from schedcc.backends.run import models

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4), recompute=True)
    segments = models.mlp_segments(2, width=8, seed=1)
    oracle = copy.deepcopy(segments)
    data = models.TeacherData(width=8, seed=2)
    steps = [data.batch(8, step) for step in range(2)]
    engine = DistributedEngine(program, segments, F.mse_loss, sgd, timeout=60)
    losses = list(engine.train(steps))
    local = Engine(program, oracle, F.mse_loss, sgd)
    expected = list(local.train(steps))
    if rank == 1:
        assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12, (losses, expected)
    k = rank
    for got, want in zip(segments[k].parameters(), oracle[k].parameters()):
        assert torch.allclose(got, want, rtol=0, atol=1e-12), k
    assert engine.peak_activation_bytes[rank] == local.peak_activation_bytes[rank]
    dist.destroy_process_group()
    return 0


def test_distributed_recompute_equals_local():
    """gloo, 2 processes over shared memory: a program with recomputation trains to the local
    backend's numbers and holds the same activation bytes."""
    from schedcc.backends.run.launch import spawn

    assert spawn(_distributed_worker, 2, grace=60, threads=1) == 0


def test_a_recomputing_engine_evaluates_and_export_to_torch_is_refused():
    """An engine on a recomputing program still evaluates and predicts (forward-only runs keep
    nothing); exporting it as torch actions is refused, torch having no recompute."""
    from schedcc.interop.torch import to_torch_actions

    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4), recompute=True)
    engine = Engine(program, make_segments(2), mse, sgd)
    x, y = batches(1, 8)[0]
    engine.train_step(x, y)
    assert engine.evaluate(x, y) == engine.train_step(x, y)
    assert engine.predict(x).shape == x.shape
    with pytest.raises(ScheduleConfigError, match="no recompute"):
        to_torch_actions(program)


@given(
    name=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "2bw"]),
    p=st.integers(1, 3),
    m=st.integers(1, 3),
    parallel=st.sampled_from([(1, 0), (2, 1)]),
    edits=mutations(),
)
def test_a_mutated_recomputing_program_is_rejected_or_trains_exactly(name, p, m, parallel, edits):
    """Drop, duplicate, swap or move instructions of a recomputing program (its `R`s included):
    the validator raises a `ScheduleError`, or the result trains exactly on the local backend."""
    cls = schedcc.get_schedule(name)
    try:
        schedule = cls(p, m, 2 if name == "interleaved-1f1b" else 1)
    except ScheduleConfigError:
        return
    data_parallel, zero = parallel
    program = schedcc.compile(schedule, data_parallel=data_parallel, zero=zero, recompute=True)
    mutated = program.evolve(stages=mutate(program.stages, edits, schedule.num_chunks))
    if accepted(mutated):
        trains_exactly(mutated)
