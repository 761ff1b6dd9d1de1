"""The byte model under ZeRO 0/1/2/3 at dp=2 against what the local engine holds.

After every instruction of every stage, the simulator's parameter, gradient and total bytes
(`schedcc.semantics.stage_held`, `Timeline.stage_bytes`) equal the bytes the engine's runtime
holds then: its parameters' and shards' storages, its gradients' and its activations'.
"""

from __future__ import annotations

import pytest
import torch
from _models import batches, make_segments, mse, sgd
from _tied_models import tied_segments

import schedcc
from schedcc.backends.local import Engine
from schedcc.backends.runtime.memory import measure_memory
from schedcc.costs import CostModel
from schedcc.ir import COMM, ReduceTied
from schedcc.semantics.stage_bytes import (
    chunk_sizes,
    held_gradient_bytes,
    held_parameter_bytes,
    held_stash_bytes,
    stage_held,
)

WIDTH = 8  # one segment: 72 float64 values, split evenly in two shards


def _trained(runtime) -> list:
    """The parameters the runtime trains: its modules', with a tie's private copy in place of
    the shared Parameter another stage trains."""
    return [p for view in runtime._views for p in view.parameters()]


def _parameter_bytes(runtime) -> int:
    """Bytes of the distinct storages behind the runtime's parameters and shards."""
    tensors = _trained(runtime) + runtime.state.shards
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _gradient_bytes(runtime) -> int:
    """Bytes of the gradients the runtime's parameters and shards hold (a shard's gradient
    that views the parameters' gradient buffer, as under ZeRO-1, counted with it)."""
    grads = [p.grad for p in _trained(runtime) if p.grad is not None]
    seen = {g.untyped_storage().data_ptr() for g in grads}
    for shard in runtime._reducer.shards:
        if shard.grad is not None and shard.grad.untyped_storage().data_ptr() not in seen:
            grads.append(shard.grad)
    return sum(g.numel() * g.element_size() for g in grads)


def _measure(runtime, record: list) -> None:
    """Append (instruction, parameter, gradient, activation bytes) after each instruction."""
    run = runtime.run

    def measured(op):
        run(op)
        record.append(
            (op, _parameter_bytes(runtime), _gradient_bytes(runtime), runtime.activation_bytes)
        )

    runtime.run = measured


def _compare(program, segments, fresh, zero: int) -> list:
    """Train one step, recording each stage's bytes after each instruction; assert the
    simulator's equal them. Returns each stage's record and parameter bytes by chunk."""
    schedule = program.schedule
    (x, y) = batches(1, 8, width=WIDTH)[0]
    rows = 8 // (2 * schedule.num_microbatches)  # a replica's half of the batch, in m parts
    memory = measure_memory(fresh, x[:rows], y[:rows], mse)
    engine = Engine(program, segments, mse, sgd)
    records = [[] for _ in engine.runtimes[0]]
    for runtime, record in zip(engine.runtimes[0], records):
        _measure(runtime, record)
    engine.train_step(x, y)
    timeline = schedcc.simulate(program, CostModel(memory=memory))
    for s, (ops, record) in enumerate(zip(program.stages, records)):
        # the local engine moves values and meets for ReduceTied itself: the record has every
        # other instruction (a ReduceTied changes no byte count)
        at = [pos for pos, op in enumerate(ops) if not isinstance(op, (*COMM, ReduceTied))]
        assert [op for op, *_ in record] == [ops[pos] for pos in at]
        params = chunk_sizes(program, memory, s, "parameters")
        grads = chunk_sizes(program, memory, s, "gradients")
        _, simulated_params = held_parameter_bytes(ops, params, zero=zero, data_parallel=2)
        simulated_grads = held_gradient_bytes(ops, grads, zero=zero, data_parallel=2)
        _, simulated_total, peak = stage_held(program, memory, s, ops, program.rule_versions[s])
        assert [simulated_params[pos] for pos in at] == [p for _, p, _, _ in record], s
        assert [simulated_grads[pos] for pos in at] == [g for _, _, g, _ in record], s
        assert [simulated_total[pos] for pos in at] == [p + g + a for _, p, g, a in record], s
        assert timeline.stage_bytes[s] == peak
        assert peak.parameters == max(p for _, p, _, _ in record)
        assert peak.gradients == max(g for _, _, g, _ in record)
        assert peak.total == max(p + g + a for _, p, g, a in record)
    return records, [chunk_sizes(program, memory, s, "parameters") for s in range(len(records))]


@pytest.mark.parametrize(("name", "v"), [("1f1b", 1), ("zb-v", 2)])
def test_simulated_bytes_equal_measured_with_a_tie_under_zero_3(name, v):
    """A tied chunk stays whole from its Unshard until after its ReduceTied and reduce-scatter:
    per instruction the simulated parameter, gradient and total bytes equal what the runtime
    holds, a tie's private copy counted as its chunk's own (zb-v: both copies on stage 0)."""
    schedule = schedcc.get_schedule(name)(2, 4, num_chunks=v)
    last = schedule.num_segments - 1
    program = schedcc.compile(schedule, data_parallel=2, zero=3, tied=[(0, last)])
    records, sizes = _compare(
        program,
        tied_segments(schedule.num_segments, width=WIDTH),
        tied_segments(schedule.num_segments, width=WIDTH),
        3,
    )
    for record, params in zip(records, sizes):
        assert record[-1][1] == sum(params) / 2  # only the shards once the last Reshard ran


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize(("name", "v"), [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_simulated_bytes_equal_measured_under_zero(name, v, zero):
    """dp=2, p=2, m=4, one batch: per instruction the simulated parameter bytes (ZeRO-1/2:
    whole + the stepped shard; ZeRO-3: the shard, whole from Unshard to Reshard), gradient
    bytes (shards after each reduce-scatter) and totals equal the measured ones, and so do the
    timeline's peaks: 1.5x the whole parameters under ZeRO-1/2, the whole under ZeRO-0/3, and
    under ZeRO-3 only the shard once the last Reshard has run."""
    schedule = schedcc.get_schedule(name)(2, 4, num_chunks=v)
    program = schedcc.compile(schedule, data_parallel=2, zero=zero)
    segments = make_segments(schedule.num_segments, width=WIDTH)
    fresh = make_segments(schedule.num_segments, width=WIDTH)
    records, sizes = _compare(program, segments, fresh, zero)
    for record, params in zip(records, sizes):
        peak = max(p for _, p, _, _ in record)
        whole = sum(params)
        assert peak == {0: whole, 1: 1.5 * whole, 2: 1.5 * whole, 3: whole}[zero]
        if zero == 3:  # only the shards before the first Unshard and after the last Reshard
            assert record[-1][1] == whole / 2


def test_simulated_stash_equals_measured_under_2bw():
    """2BW over three batches (the third runs on version 1): after every instruction the
    simulated bytes of stashed weight copies (`held_stash_bytes`) equal the storages of the
    copies the runtime or its graphs still hold, two versions at once around the step."""
    schedule = schedcc.get_schedule("2bw")(2, 4, num_batches=3)
    program = schedcc.compile(schedule)
    engine = Engine(program, make_segments(2, width=WIDTH), mse, sgd)
    records = []
    for runtime in engine.runtimes[0]:
        record: list = []
        records.append(record)
        _measure_stash(runtime, record)
    list(engine.train(batches(3, 8, width=WIDTH)))
    memory = measure_memory(make_segments(2, width=WIDTH), *batches(1, 2, width=WIDTH)[0], mse)
    rows = program.rule_versions
    for s, (ops, record) in enumerate(zip(program.stages, records)):
        at = [pos for pos, op in enumerate(ops) if not isinstance(op, COMM)]
        assert [op for op, _ in record] == [ops[pos] for pos in at]
        params = chunk_sizes(program, memory, s, "parameters")
        _, simulated = held_stash_bytes(ops, rows[s], params, schedule.weight_delay)
        assert [simulated[pos] for pos in at] == [held for _, held in record], s
        assert max(simulated) == 2 * sum(params)


def _measure_stash(runtime, record: list) -> None:
    """Append (instruction, bytes of stashed weight copies alive) after each instruction of
    the next run; a copy is followed by a weak reference to its storage (a graph may keep it
    after the runtime has dropped the tensor)."""
    alive: dict[int, tuple[int, int]] = {}

    def follow(tensors) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            alive[storage.data_ptr()] = (storage._weak_ref(), storage.nbytes())

    reset, run = runtime.reset, runtime.run

    def resetting(**kwargs) -> None:  # a run starts on new versions, version 0 stashed
        reset(**kwargs)
        versions = runtime._versions
        for stash in versions._stash:
            for params in stash.values():
                follow(params.values())
        snapshot = versions.snapshot

        def stashing(c: int, version: int) -> None:
            snapshot(c, version)
            follow(versions._stash[c].get(version, {}).values())

        versions.snapshot = stashing

    def measured(op) -> None:
        run(op)
        for ptr, (ref, _) in list(alive.items()):
            if torch.UntypedStorage._expired(ref):
                torch.UntypedStorage._free_weak_ref(ref)
                del alive[ptr]
        record.append((op, sum(nbytes for _, nbytes in alive.values())))

    runtime.reset, runtime.run = resetting, measured
