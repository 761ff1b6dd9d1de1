"""The features meet: overlapped pairs and model replicas (the DualPipes) with recomputation,
ZeRO-2/3 and gradient-norm clipping, each trained on the local backend against non-pipelined
training (float64, 1e-10)."""

from __future__ import annotations

import itertools

import pytest
from _models import batches, make_segments, mse, sgd
from strategies import PLAIN_BUILTINS

import schedcc
from schedcc.backends.reference import assert_matches_reference
from schedcc.ir import OverlappedBackward, Recompute, Reshard, Unshard
from schedcc.registry import build_schedule


def _pairs_intact(program) -> None:
    """Every `+B` still directly follows its pair's forward after the passes."""
    for ops in program.stages:
        for before, op in itertools.pairwise(ops):
            if type(op) is OverlappedBackward:
                assert type(before) is schedcc.ir.Forward, (before, op)


def _data(dp: int):
    data = batches(2, 8 * dp)
    if dp == 1:
        return data
    return [list(zip(x.chunk(dp), y.chunk(dp))) for x, y in data]


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("dualpipe-v", {"recompute": True}),
        ("dualpipe-v", {"data_parallel": 2, "zero": 3}),
        ("dualpipe-v", {"data_parallel": 2, "zero": 3, "recompute": True, "grad_norm": True}),
        ("dualpipe", {"recompute": True, "grad_norm": True}),
        ("dualpipe", {"data_parallel": 2, "zero": 2, "recompute": True}),
    ],
)
def test_dualpipes_with_recompute_zero_and_clipping_train_exactly(name, options):
    schedule = schedcc.get_schedule(name)(2, 4, num_batches=2)
    program = schedcc.compile(schedule, **options)
    _pairs_intact(program)
    kinds = {type(op) for ops in program.stages for op in ops}
    assert (Recompute in kinds) == options.get("recompute", False)
    assert ({Unshard, Reshard} <= kinds) == (options.get("zero") == 3)
    replicas = type(schedule).num_replicas
    parts = make_segments(schedule.num_segments // replicas)
    clip = 0.05 if options.get("grad_norm") else None
    worst = assert_matches_reference(
        program,
        parts * replicas,
        mse,
        sgd,
        _data(options.get("data_parallel", 1)),
        max_grad_norm=clip,
    )
    assert worst < 1e-10


def test_an_overlapped_backward_is_recomputed_before_its_pair():
    """`compile(recompute=True)` puts the `R` of a microbatch whose first backward is a `+B`
    before the pair's forward, and the validator refuses an `R` after a `+B`."""
    schedule = schedcc.get_schedule("dualpipe-v")(2, 4)
    program = schedcc.compile(schedule, recompute=True)
    ops = program.stages[0]
    pairs = [pos for pos, op in enumerate(ops) if type(op) is OverlappedBackward]
    assert pairs
    for pos in pairs:
        op = ops[pos]
        assert type(ops[pos - 1]) is schedcc.ir.Forward
        assert ops.index(Recompute(op.microbatch, op.chunk)) < pos - 1
    plain = schedcc.compile(schedule, validate=False)
    rows = [list(ops) for ops in plain.stages]
    row = rows[0]
    late = next(pos for pos, op in enumerate(row) if type(op) is OverlappedBackward)
    row.insert(late + 1, Recompute(row[late].microbatch, row[late].chunk))
    with pytest.raises(schedcc.ScheduleError, match="after its backward began"):
        schedcc.validate(plain.evolve(stages=tuple(tuple(r) for r in rows)))


@pytest.mark.parametrize("name", PLAIN_BUILTINS)
def test_every_built_in_clips_exactly_over_several_batches_per_run(name):
    """`grad_norm=True` on a program of two batches: the norm of batch 0 goes before its step on
    every stage even where the next batch's comm was posted early, and training with clipping
    equals clip_grad_norm_ on the non-pipelined model."""
    schedule = build_schedule(schedcc.get_schedule(name), 2, 4, num_batches=2)
    program = schedcc.compile(schedule, grad_norm=True)
    replicas = type(schedule).num_replicas
    parts = make_segments(schedule.num_segments // replicas)
    worst = assert_matches_reference(
        program, parts * replicas, mse, sgd, batches(4, 8), max_grad_norm=0.05
    )
    assert worst < 1e-10


def test_a_memory_model_of_one_replica_prices_dualpipe_s_copies():
    """`measure_memory` on the parts gives one replica's sizes; the simulator reads them for
    every copy, and its activation bytes equal what the engine holds on every stage."""
    from schedcc.backends.local import Engine
    from schedcc.backends.runtime.memory import measure_memory

    schedule = schedcc.get_schedule("dualpipe")(2, 4)
    program = schedcc.compile(schedule)
    parts = make_segments(2)
    ((x, y),) = batches(1, 8)
    memory = measure_memory(parts, x[:2], y[:2], mse, sgd)
    engine = Engine(program, parts + parts, mse, sgd)
    list(engine.train([(x, y)]))
    timeline = schedcc.simulate(program, schedcc.CostModel(memory=memory))
    measured = [rt.peak_activation_bytes for rt in engine.runtimes[0]]
    assert list(timeline.peak_activation_bytes) == measured
    assert min(measured) > 0
