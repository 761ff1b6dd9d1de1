"""The byte model under ZeRO 0/1/2/3 at dp=2 against what the local engine holds.

After every instruction of every stage, the simulator's parameter, gradient and total bytes
(`schedcc.memory.stage_held`, `Timeline.stage_bytes`) equal the bytes the engine's runtime
holds then: its parameters' and shards' storages, its gradients' and its activations'.
"""

from __future__ import annotations

import pytest
from _models import batches, make_segments, mse, sgd

import schedcc
from schedcc.backends.local import Engine
from schedcc.backends.runtime.memory import measure_memory
from schedcc.costs import CostModel
from schedcc.ir import COMM
from schedcc.memory import chunk_sizes, held_gradient_bytes, held_parameter_bytes, stage_held
from schedcc.semantics import rule_versions

WIDTH = 8  # one segment: 72 float64 values, split evenly in two shards


def _parameter_bytes(runtime) -> int:
    """Bytes of the distinct storages behind the runtime's parameters and shards."""
    tensors = [p for mod in runtime.modules for p in mod.parameters()] + runtime.shards
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _gradient_bytes(runtime) -> int:
    """Bytes of the gradients the runtime's parameters and shards hold."""
    params = [p for mod in runtime.modules for p in mod.parameters()]
    params += list(runtime._reducer.shards)
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)


def _measure(runtime, record: list) -> None:
    """Append (instruction, parameter, gradient, activation bytes) after each instruction."""
    run = runtime.run

    def measured(op):
        run(op)
        record.append(
            (op, _parameter_bytes(runtime), _gradient_bytes(runtime), runtime.activation_bytes)
        )

    runtime.run = measured


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize(("name", "v"), [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_simulated_bytes_equal_measured_under_zero(name, v, zero):
    """dp=2, p=2, m=4, one batch: per instruction the simulated parameter bytes (ZeRO-1/2:
    whole + the stepped shard; ZeRO-3: the shard, whole from Unshard to Reshard), gradient
    bytes (shards after each reduce-scatter) and totals equal the measured ones, and so do the
    timeline's peaks; ZeRO-3 holds fewer parameter bytes at its peak than ZeRO-0."""
    schedule = schedcc.get_schedule(name)(2, 4, num_chunks=v)
    program = schedcc.compile(schedule, data_parallel=2, zero=zero)
    (x, y) = batches(1, 8, width=WIDTH)[0]
    rows = 8 // (2 * 4)  # a replica's half of the batch, in m microbatches
    memory = measure_memory(
        make_segments(schedule.num_segments, width=WIDTH), x[:rows], y[:rows], mse
    )
    engine = Engine(program, make_segments(schedule.num_segments, width=WIDTH), mse, sgd)
    records = [[] for _ in engine.runtimes[0]]
    for runtime, record in zip(engine.runtimes[0], records):
        _measure(runtime, record)
    engine.train_step(x, y)
    timeline = schedcc.simulate(program, CostModel(memory=memory))
    for s, (ops, record) in enumerate(zip(program.stages, records)):
        # the local engine moves values itself: the record has every instruction but the comm
        at = [pos for pos, op in enumerate(ops) if not isinstance(op, COMM)]
        assert [op for op, *_ in record] == [ops[pos] for pos in at]
        params = chunk_sizes(program, memory, s, "parameters")
        grads = chunk_sizes(program, memory, s, "gradients")
        _, simulated_params = held_parameter_bytes(ops, params, zero=zero, data_parallel=2)
        simulated_grads = held_gradient_bytes(ops, grads, zero=zero, data_parallel=2)
        _, simulated_total, peak = stage_held(program, memory, s, ops, rule_versions(program)[s])
        assert [simulated_params[pos] for pos in at] == [p for _, p, _, _ in record], s
        assert [simulated_grads[pos] for pos in at] == [g for _, _, g, _ in record], s
        assert [simulated_total[pos] for pos in at] == [p + g + a for _, p, g, a in record], s
        assert timeline.stage_bytes[s] == peak
        assert peak.parameters == max(p for _, p, _, _ in record)
        assert peak.gradients == max(g for _, _, g, _ in record)
        assert peak.total == max(p + g + a for _, p, g, a in record)
        whole = sum(params)
        assert peak.parameters == {0: whole, 1: 1.5 * whole, 2: 1.5 * whole, 3: whole}[zero]
        if zero == 3:  # only the shards before the first Unshard and after the last Reshard
            assert record[-1][1] == whole / 2
