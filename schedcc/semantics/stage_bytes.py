"""Bytes per stage: what a stage holds at each point of its program, by kind.

A `MemoryModel` gives the bytes of each segment; this module follows them through one stage's
program, the way the engines hold them, for the simulator (`Timeline.stage_bytes`), the
validator (`check_bytes`) and `schedcc.tune`. Activations are counted as
`schedcc.semantics.activations` counts them.

[Note: bytes per stage] At each point of a stage's program it holds, for each of its segments
k (chunk c):
- activations: of the microbatches held there (each from its forward, or its `Recompute`, to
  its last backward piece) times `activations[k]`, and the inputs (`inputs[k]`) that recomputed
  forwards keep until their `Recompute` (`held_bytes`);
- parameters (`parameters[k]`): whole without ZeRO; under ZeRO-1 and 2 whole plus this rank's
  flat shard that the optimizer steps (`parameters[k] / dp` more); under ZeRO-3 whole from the
  chunk's `Unshard` to its `Reshard` (the shard is then a slice of the gathered buffer) and only
  the shard, `parameters[k] / dp`, otherwise (`held_parameter_bytes`); under a weight delay
  (2BW) also a copy per weight version that computes still use (`held_stash_bytes`);
- gradients (`gradients[k]`, `parameters[k]` if not given): whole, in the chunk's gradient
  buffer, from its first weight-gradient compute (B or W) until the `OptimizerStep` without
  ZeRO and under ZeRO-1 (whose shard's gradient is a slice of that buffer); under ZeRO-2 and 3
  until its launched reduce-scatters are waited other than by a weight gradient of the chunk
  (which reuses the buffer): at the chunk's `Reshard` or `GatherParams`, or the stage's
  `GradNorm` or `OptimizerStep`; and this rank's shard of them, `gradients[k] / dp`, from the
  chunk's first `ReduceGrads` until the step (`held_gradient_bytes`; [Note: contiguous gradient
  buckets] in `backends/runtime/zero.py`);
- optimizer state (`optimizer[k]`, divided by `dp` under ZeRO >= 1), counted as held throughout.
A stage's peak is the most it holds at once (`stage_peak`): the largest total over the points
of its program, which can be less than the sum of each kind's own peak.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from schedcc.errors import ScheduleConfigError
from schedcc.ir import (
    COMPUTE,
    WEIGHT_GRADIENT,
    GatherParams,
    GradNorm,
    OptimizerStep,
    ReduceGrads,
    Reshard,
    Unshard,
)
from schedcc.memory_model import MemoryModel
from schedcc.semantics.activations import held_bytes

__all__ = [
    "StageBytes",
    "chunk_part_sizes",
    "chunk_sizes",
    "held_gradient_bytes",
    "held_parameter_bytes",
    "held_stash_bytes",
    "peak_activation_bytes",
    "resident_parameters",
    "stage_held",
    "stage_peak",
]


def resident_parameters(parameter_bytes: float, *, zero: int, data_parallel: int) -> float:
    """The bytes of a segment's parameters a rank holds between uses: whole without ZeRO;
    whole plus this rank's flat shard (the copy the optimizer steps) under ZeRO-1 and 2; only
    the shard under ZeRO-3 (whole again from the chunk's `Unshard` to its `Reshard`).

    >>> [resident_parameters(100.0, zero=z, data_parallel=4) for z in (0, 1, 2, 3)]
    [100.0, 125.0, 125.0, 25.0]
    """
    if zero >= 3:
        return parameter_bytes / data_parallel
    if zero >= 1:
        return parameter_bytes + parameter_bytes / data_parallel
    return parameter_bytes


def held_parameter_bytes(
    ops: Sequence, per_chunk: Sequence[float], *, zero: int, data_parallel: int
) -> tuple[float, list[float]]:
    """`(before, after)`: the parameter bytes one stage's program holds before its first
    instruction and after each, when chunk c's parameters take `per_chunk[c]` bytes (see
    [Note: bytes per stage]; 2BW's stashed copies are not counted here).

    >>> from schedcc.ir import parse
    >>> ops = [parse(op) for op in "Unshard F0 Unshard.1 F0.1 Reshard Reshard.1".split()]
    >>> held_parameter_bytes(ops, [100.0, 10.0], zero=3, data_parallel=2)
    (55.0, [105.0, 105.0, 110.0, 110.0, 60.0, 55.0])
    """
    resident = [resident_parameters(b, zero=zero, data_parallel=data_parallel) for b in per_chunk]
    held = sum(resident)
    if zero < 3:
        return held, [held] * len(ops)
    whole = [False] * len(per_chunk)
    out = []
    for op in ops:
        kind = type(op)
        if kind is Unshard and not whole[op.chunk]:
            whole[op.chunk] = True
            held += per_chunk[op.chunk] - resident[op.chunk]
        elif kind is Reshard and whole[op.chunk]:
            whole[op.chunk] = False
            held -= per_chunk[op.chunk] - resident[op.chunk]
        out.append(held)
    return sum(resident), out


def held_gradient_bytes(
    ops: Sequence, per_chunk: Sequence[float], *, zero: int, data_parallel: int
) -> list[float]:
    """The gradient bytes one stage's program holds after each instruction (none before the
    first), when chunk c's gradients take `per_chunk[c]` bytes (see [Note: bytes per stage]).

    >>> from schedcc.ir import parse
    >>> ops = [parse(op) for op in "F0 F1 B0 Reduce B1 Reduce Norm Step".split()]
    >>> held_gradient_bytes(ops, [100.0], zero=2, data_parallel=4)
    [0.0, 0.0, 100.0, 125.0, 125.0, 125.0, 25.0, 0.0]
    """
    whole = [False] * len(per_chunk)
    shard = [False] * len(per_chunk)
    held, out = 0.0, []

    def waited(c: int) -> float:  # under ZeRO the wait drops the whole buffer
        if not whole[c]:
            return 0.0
        whole[c] = False
        return per_chunk[c]

    for op in ops:
        kind = type(op)
        if isinstance(op, WEIGHT_GRADIENT):
            if not whole[op.chunk]:
                whole[op.chunk] = True
                held += per_chunk[op.chunk]
        elif zero < 2 and kind is not OptimizerStep:  # ZeRO-1: the shard's is in the buffer
            pass
        elif kind is ReduceGrads:
            c = op.chunk
            if not shard[c]:
                shard[c] = True
                held += per_chunk[c] / data_parallel
        elif kind in (Reshard, GatherParams):
            held -= waited(op.chunk)
        elif kind is GradNorm:
            held -= sum(waited(c) for c in range(len(per_chunk)))
        elif kind is OptimizerStep:
            whole = [False] * len(per_chunk)
            shard = [False] * len(per_chunk)
            held = 0.0
        out.append(held)
    return out


@attrs.frozen(slots=True)
class StageBytes:
    """What one stage holds, in bytes, by kind (see [Note: bytes per stage]): each kind the
    most of it held at once over the program, and `total` the most of all of them held at once
    (at most the sum of the others)."""

    activations: float
    parameters: float
    stashed: float
    gradients: float
    optimizer: float
    total: float


def chunk_sizes(program, memory: MemoryModel, stage: int, field: str) -> list[float]:
    """`field`'s bytes of each chunk's segment on `stage`, by chunk."""
    schedule = program.schedule
    return [memory.at(field, schedule.segment_of(stage, c)) for c in range(schedule.num_chunks)]


def chunk_part_sizes(program, memory: MemoryModel, stage: int) -> list | None:
    """`MemoryModel.part_sizes` of each chunk's segment on `stage`, by chunk (None: none)."""
    schedule = program.schedule
    if memory.part_activations is None or schedule.num_parts == 1:
        return None
    sizes = [memory.part_sizes(schedule.segment_of(stage, c)) for c in range(schedule.num_chunks)]
    if any(len(row) != schedule.num_parts for row in sizes):
        raise ScheduleConfigError(
            f"MemoryModel.part_activations gives {sorted({len(row) for row in sizes})} part "
            f"sizes per segment but {schedule!r} has {schedule.num_parts} parts: give one per part"
        )
    return sizes


def held_stash_bytes(
    ops: Sequence, row: Sequence[int | None], per_chunk: Sequence[float], weight_delay: int
) -> tuple[float, list[float]]:
    """`(before, after)`: the bytes of stashed weight copies one stage's program holds before
    its first instruction and after each, under a weight delay (2BW; none without one).

    The engines run every forward of a delayed program on a copy of its version's weights
    (the live ones are the optimizer's): chunk c's copy of version k is taken at the start
    (k = 0) or at the step that makes k, if a compute of chunk c uses k, and is held until the
    last such compute (the graph keeps it until its last backward piece). `row` is the
    version of each position (`schedcc.semantics.versions_of`).

    >>> from schedcc.ir import parse
    >>> from schedcc.semantics import versions_of
    >>> ops = [parse(op) for op in "F0 B0 Step F1 B1 Step F2 B2".split()]
    >>> held_stash_bytes(ops, versions_of(ops, 1, 1), [10.0], 1)
    (10.0, [10.0, 10.0, 20.0, 20.0, 10.0, 10.0, 10.0, 0.0])
    """
    if not weight_delay:
        return 0.0, [0.0] * len(ops)
    born = {0: -1}
    last: dict[tuple[int, int], int] = {}
    for pos, op in enumerate(ops):
        if type(op) is OptimizerStep:
            born.setdefault(row[pos], pos)
        elif isinstance(op, COMPUTE):
            last[op.chunk, row[pos]] = pos
    changes = [0.0] * (len(ops) + 1)  # changes[pos + 1]: after the instruction at pos
    for (c, version), end in last.items():
        start = born.get(version, -1)
        if start < end:
            changes[start + 1] += per_chunk[c]
            changes[end + 1] -= per_chunk[c]
    held, out = changes[0], []
    for change in changes[1:]:
        held += change
        out.append(held)
    return changes[0], out


def stage_held(
    program, memory: MemoryModel, stage: int, ops: Sequence, row: Sequence[int | None]
) -> tuple[float, list[float], StageBytes]:
    """`(before, after, peak)` for one stage's program `ops`: the bytes it holds before its
    first instruction (parameters, stashed copies and optimizer state), after each
    instruction, and its peak by kind (`StageBytes`); `row` is the weight version of each
    position (`Program.rule_versions`), for 2BW's stashed copies."""
    dp, zero = program.data_parallel, program.zero
    params = chunk_sizes(program, memory, stage, "parameters")
    delay = program.schedule.weight_delay
    if program.forward_only:  # no stash, no graph, no gradient
        activations = [0.0] * len(ops)
        gradients = [0.0] * len(ops)
        delay = 0
    else:
        sizes = chunk_sizes(program, memory, stage, "activations")
        inputs = chunk_sizes(program, memory, stage, "inputs")
        parts = chunk_part_sizes(program, memory, stage)
        activations = held_bytes(ops, sizes, inputs, parts)
        grads = chunk_sizes(program, memory, stage, "gradients")
        gradients = held_gradient_bytes(ops, grads, zero=zero, data_parallel=dp)
    start, parameters = held_parameter_bytes(ops, params, zero=zero, data_parallel=dp)
    stash_start, stashed = held_stash_bytes(ops, row, params, delay)
    state = sum(chunk_sizes(program, memory, stage, "optimizer"))
    optimizer = state / dp if zero >= 1 else state
    before = start + stash_start + optimizer
    after = [
        a + p + w + g + optimizer for a, p, w, g in zip(activations, parameters, stashed, gradients)
    ]
    peak = StageBytes(
        activations=max(activations, default=0.0),
        parameters=max([start, *parameters]),
        stashed=max([stash_start, *stashed]),
        gradients=max(gradients, default=0.0),
        optimizer=optimizer,
        total=max([before, *after]),
    )
    return before, after, peak


def stage_peak(program, memory: MemoryModel, stage: int) -> StageBytes:
    """The peak bytes of `program`'s `stage` by kind (`StageBytes`; see `stage_held`)."""
    row = program.rule_versions[stage]
    return stage_held(program, memory, stage, program.stages[stage], row)[2]


def peak_activation_bytes(program, memory: MemoryModel, stage: int) -> float:
    """The most activation bytes `program`'s `stage` holds at once: its held microbatches
    weighted by each segment's `memory.activations`, plus the inputs recomputed forwards keep
    until their `Recompute` (none in a forward-only program, whose forwards keep nothing)."""
    if program.forward_only:
        return 0.0
    sizes = chunk_sizes(program, memory, stage, "activations")
    inputs = chunk_sizes(program, memory, stage, "inputs")
    parts = chunk_part_sizes(program, memory, stage)
    return max(held_bytes(program.stages[stage], sizes, inputs, parts), default=0.0)
