"""`CostModel`: what each instruction costs in a simulation, by kind, stage and chunk.

Given by hand (`CostModel(forward=1, backward=2, comm=0.1, per_stage={...})`) or measured
(`CostModel.from_trace("run.json")`, the medians of a real run's Chrome trace).

    >>> from schedcc.costs import CostModel
    >>> CostModel(forward=1.5, per_stage={3: CostModel(forward=3.0)}).at(3).forward
    3.0
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from math import inf
from os import PathLike
from types import MappingProxyType
from typing import NamedTuple

import attrs

from schedcc.draw.chrome import read_chrome_trace, track_stage
from schedcc.errors import ScheduleConfigError
from schedcc.ir import (
    COMM,
    COMPUTE,
    COPY,
    UPDATE,
    Backward,
    BackwardInput,
    BackwardWeight,
    Comm,
    Forward,
    GatherParams,
    GradNorm,
    Instruction,
    Offload,
    OptimizerStep,
    OverlappedBackward,
    Recompute,
    ReduceGrads,
    ReduceTied,
    Reload,
    Reshard,
    Unshard,
    parse,
)
from schedcc.memory_model import MemoryModel

__all__ = [
    "ALL_KINDS",
    "CHUNK_FIELDS",
    "FIELD_OF_CODE",
    "FIXED_OF",
    "CostModel",
    "MeasuredUpdates",
    "WARMUP_FIELDS",
    "cost_fields",
    "fixed_merge",
    "fixed_share",
    "kind_cost",
    "measured_backward",
    "measured_updates",
    "overlapped_pair",
    "segment_remotes",
    "segment_takes",
    "takes",
    "warmups",
]

#: The cost field each instruction class reads (comm instructions all read `comm`).
_FIELD: dict[type[Instruction], str] = {
    Forward: "forward",
    Backward: "backward",
    BackwardInput: "backward_input",
    BackwardWeight: "backward_weight",
    Recompute: "recompute",
    Offload: "offload",
    Reload: "reload",
    ReduceGrads: "reduce",
    ReduceTied: "reduce",
    GradNorm: "norm",
    OptimizerStep: "step",
    GatherParams: "gather",
    Unshard: "gather",
    Reshard: "release",
}
#: The same keyed by instruction code (`F`, `Tied`, ...), as `--costs` and `tune` name them.
FIELD_OF_CODE = MappingProxyType({cls.code: field for cls, field in _FIELD.items()})
#: The fields a chunk of a stage cut in v pays 1/v of (`schedcc.tune`, [Note: tune's units]):
#: its computes and its copies (an offload moves 1/v of the bytes).
CHUNK_FIELDS = (
    *(FIELD_OF_CODE[cls.code] for cls in COMPUTE if cls.code in FIELD_OF_CODE),
    "offload",
    "reload",
)
ALL_KINDS = (*COMPUTE, *COMM, *COPY, *UPDATE)


def kind_cost(model: CostModel, cls: type[Instruction]) -> float:
    """The field of `model` that instructions of class `cls` cost (a `Recompute` without its
    own cost costs a forward; an `OverlappedBackward` what its pair takes beyond its forward,
    see `overlapped_pair`)."""
    if issubclass(cls, Comm):
        return model.comm
    if cls is Recompute and model.recompute is None:
        return model.forward
    if cls is OverlappedBackward:
        return overlapped_pair(model) - model.forward
    return getattr(model, _FIELD[cls])


# [Note: a step's first computes] On the CPU engines a stage's first forward of a step takes
# 30-50% longer than the rest, and its first backward 10-20% (tiny-gpt at p = 2: 0.5-1.0 ms on a
# 1.9 ms forward, 0.2-0.4 ms on a 1.8 ms backward; docs/performance.md, "The updates a run
# compiles, a collective's wait, a step's first computes"): the optimizer step has just written
# every parameter, and the first pass of a step allocates what the rest reuse. A median of each
# kind leaves that out, and on the critical path of a pipeline's fill it adds up: steps
# simulated 7-17% under what they measured. The parameters are the chunk's: at v = 2 each chunk's
# first forward is slow in its turn (stage 1: 0.43 ms each, against 0.97 for its one chunk at
# v = 1). So the costs carry it per stage in tune's units (`warmup_forward`, `warmup_backward`, a
# stage's at v = 1, each of v chunks taking 1 / v of it: `WARMUP_FIELDS`), the simulators add
# each chunk's to its first compute of each kind in program order (`warmups`), and `from_trace`
# reads it as the median, over the runs a trace holds (a track's runs are split at its `Step`s),
# of each chunk's first forward's duration less the median forward of that chunk, summed over
# the stage's chunks (likewise backwards); a simulated trace reads back what it was simulated
# with.
def warmups(
    costs: CostModel, stages: Sequence[Sequence[Instruction]]
) -> dict[tuple[int, int], float]:
    """`{(stage, position): extra}`: on each stage, each chunk's first forward and first
    backward (B, I, or an overlapped pair's) of the program `stages`, and what they take beyond
    their cost, its chunk's `warmup_forward` or `warmup_backward` ([Note: a step's first
    computes]); none where the costs have no warm-up."""
    out: dict[tuple[int, int], float] = {}
    for s, ops in enumerate(stages):
        seen: set[tuple[str, int]] = set()
        for pos, op in enumerate(ops):
            field = _WARMED.get(type(op))
            if field is None or (field, op.chunk) in seen:
                continue
            seen.add((field, op.chunk))
            extra = getattr(costs.at(s, op.chunk), field)
            if extra:
                out[s, pos] = extra
    return out


#: The computes whose first of a chunk warms up, and the field it reads.
_WARMED = {
    Forward: "warmup_forward",
    Backward: "warmup_backward",
    BackwardInput: "warmup_backward",
    OverlappedBackward: "warmup_backward",
}
#: The warm-up fields: a stage's at v = 1, shared among its chunks ([Note: tune's units]).
WARMUP_FIELDS = ("warmup_forward", "warmup_backward")


# [Note: a receive's take] A message that has come is not yet its consumer's: the engine takes
# it (over shared memory, a copy out of the sender's slot; over gloo, its header read and its
# tensors unpacked) on the receiving stage's own time, before the compute that first needs it.
# tiny-gpt at p = 2 on the CPU: 0.05-0.1 ms a receive, beside 1-2 ms computes. An interleaved
# step takes one before nearly every compute, and priced without it each compute ended
# 0.07-0.09 ms later than simulated than the one before it: orders at v = 2 priced from a v = 1
# trace came out 3-19% fast. So `receive` is that time per message, apart from `comm` (its
# flight in the eager timeline, the exchange in the rendezvous one): the simulators add it to
# each compute once per message from another stage that it is the first on its stage to need
# (`takes`), and the quick clock, the exact model and the bound count it the same way (the bound
# as part of each stage's work). A measured run records each comm group's takes apart from its
# waits (the transports count the time they wait for a peer), its trace gives each receive its
# share (`"take_us"`, as `schedcc run --trace` writes it), and `from_trace` reads `receive` per
# stage as their median, and each comm op's duration less its group's takes as `comm`. A step's
# first take is slow as its first computes are ([Note: a step's first computes]): 0.2-0.43 ms
# against 0.04-0.07 for the rest, tiny-gpt at p = 2, on stage 1 before its first forward. So
# `warmup_receive` is that excess, the stage's whatever the chunk: the simulators add it to the
# first compute of the program on each stage that takes a message, the quick clock the same, the
# bound to each stage's work; `from_trace` reads it as the median over a trace's runs of each
# stage's first take less its median take.
def takes(costs: CostModel, stages: Sequence[Sequence[Instruction]], tensors) -> dict:
    """`{(stage, position): extra}`: what each compute of the program `stages` takes beyond its
    cost to take the messages from other stages it is the first on its stage to need, `receive`
    each, and the stage's first of them its `warmup_receive` more ([Note: a receive's take]);
    none where no model has either. `tensors` is the program's `schedcc.semantics.Tensors`."""
    out: dict[tuple[int, int], float] = {}
    if not _receives(costs):
        return out
    for s, ops in enumerate(stages):
        table, seen = tensors.compute_table(s), set()
        for pos, op in enumerate(ops):
            use = table.get((type(op), op.chunk)) if isinstance(op, COMPUTE) else None
            if use is None or not use.remote:
                continue
            base = op.microbatch * tensors.span
            new = {base + key for key in use.remote} - seen
            model = costs.at(s, op.chunk)
            cost = model.receive * len(new) + (0.0 if seen else model.warmup_receive)
            seen |= new
            if cost:
                out[s, pos] = cost
    return out


def segment_takes(
    place: Sequence[tuple[int, int]], models: Sequence[CostModel], length: int | None = None
) -> list[tuple[float, float]]:
    """Per segment of a placement (`place[k]` its `(stage, chunk)`, `models[k]` its costs,
    `length` segments to a model replica, default all): what its forward and its backward
    take beyond their costs for an input and a gradient from another stage, its `receive` each
    ([Note: a receive's take]); a replica's first forward and last backward take none."""
    return [
        (model.receive if up else 0.0, model.receive if down else 0.0)
        for (up, down), model in zip(segment_remotes(place, length), models, strict=True)
    ]


def segment_remotes(
    place: Sequence[tuple[int, int]], length: int | None = None
) -> list[tuple[bool, bool]]:
    """Per segment of a placement (as `segment_takes`' arguments): whether its forward takes
    its input, and its backward its gradient, from another stage."""
    length = length or len(place)
    out = []
    for k, (stage, _) in enumerate(place):
        first = k - k % length
        up, down = (first <= j < first + length and place[j][0] != stage for j in (k - 1, k + 1))
        out.append((up, down))
    return out


def _receives(costs: CostModel) -> bool:
    """Whether any model of `costs` (its own, a stage's, a chunk's) has a `receive` or a
    `warmup_receive`."""
    models = [costs, *costs.per_chunk.values()]
    for model in costs.per_stage.values():
        models += [model, *model.per_chunk.values()]
    return any(model.receive or model.warmup_receive for model in models)


# [Note: a compute's fixed time] Part of what a compute costs does not shrink with its chunk: the
# runtime's work around the segment's own ([Note: a compute's own time] in
# `backends.runtime.segment_calls`): tiny-gpt at p = 2 on the CPU, 0.1-0.2 ms of a 2.2 ms forward,
# 0.05-0.14 ms of a 2.0 ms backward. Costs are a stage's share at v = 1 ([Note: tune's units]),
# and dividing them whole by v priced a finer cut's chunks 3-9% under what they measured (and
# merging measured segments, their sum, 1-14% over). So `fixed_forward` (of each F and R) and
# `fixed_backward` (of each B, I and W) say how much of a compute's cost is fixed: a chunk of a
# stage cut in v costs `(cost - fixed) / v + fixed` (`fixed_share`), and a segment merging k
# measured ones their costs' sum less `(k - 1) * fixed` (`fixed_merge`); the fixed part is taken
# as no more than each cost. `from_trace` reads them where a run recorded each compute's own
# time (`"segment_us"`, as `schedcc run --trace` writes it): per stage, the median over its
# computes of the duration less the own time. A model's own per-segment work (set-up in each
# segment's forward) counts as the segment's, divided with it, unless traces of two cuts give
# it ([Note: a compute's per-call time]).
#: The compute fields that have a fixed part, and the field giving it.
FIXED_OF = MappingProxyType(
    {
        "forward": "fixed_forward",
        "recompute": "fixed_forward",
        "backward": "fixed_backward",
        "backward_input": "fixed_backward",
        "backward_weight": "fixed_backward",
    }
)


def fixed_share(model: CostModel, field: str, cost: float, parts: int) -> float:
    """`cost`, the `field` cost of a stage's share, as one of `parts` equal computes of it: its
    fixed part whole and the rest divided ([Note: a compute's fixed time]).

    >>> fixed_share(CostModel(fixed_forward=0.2), "forward", 2.0, 2)
    1.1
    """
    fixed = min(getattr(model, FIXED_OF[field]), cost) if field in FIXED_OF else 0.0
    return (cost - fixed) / parts + fixed


def fixed_merge(model: CostModel, field: str, costs: Sequence[float]) -> float:
    """The `field` cost of one compute merging computes of `costs`: their sum less the fixed
    part of all but one ([Note: a compute's fixed time]).

    >>> fixed_merge(CostModel(fixed_forward=0.2), "forward", [1.0, 1.5])
    2.3
    """
    fixed = min(getattr(model, FIXED_OF[field]), *costs) if field in FIXED_OF and costs else 0.0
    return sum(costs) - fixed * (len(costs) - 1)


def overlapped_pair(model: CostModel) -> float:
    """How long an overlapped forward/backward pair (`F3.1 +B1`) takes under `model`:
    `max(F, B) + overlap * min(F, B)`.

    The forward takes its own cost and the `OverlappedBackward` the rest, so the pair ends
    together and its sends leave at its end.

    >>> overlapped_pair(CostModel()), overlapped_pair(CostModel(overlap=1.0))
    (2.5, 3.0)
    """
    shorter, longer = sorted((model.forward, model.backward))
    return longer + model.overlap * shorter


def _fraction(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ScheduleConfigError(
            f"CostModel.{attribute.name} must be a fraction in [0, 1], got {value!r}"
        )


def _non_negative(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < inf:
        raise ScheduleConfigError(
            f"CostModel.{attribute.name} must be a finite non-negative number, got {value!r}"
        )


def _optional(instance, attribute, value) -> None:
    if value is not None:
        _non_negative(instance, attribute, value)


def _memory_model(instance, attribute, value) -> None:
    if value is not None and not isinstance(value, MemoryModel):
        raise ScheduleConfigError(f"CostModel.memory must be a MemoryModel, got {value!r}")


def _factors(value: Iterable[float] | None) -> tuple[float, ...]:
    """`per_microbatch` as a tuple of positive finite numbers (a `ScheduleConfigError` else)."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, Mapping)):
        raise ScheduleConfigError(
            f"CostModel.per_microbatch must be a sequence of numbers, one per microbatch of a "
            f"batch, got {value!r}"
        )
    try:
        factors = tuple(value)
    except TypeError:
        raise ScheduleConfigError(
            f"CostModel.per_microbatch must be a sequence of numbers, one per microbatch of a "
            f"batch, got {value!r}"
        ) from None
    for j, factor in enumerate(factors):
        bad = isinstance(factor, bool) or not isinstance(factor, (int, float))
        if bad or not 0 < factor < inf:
            raise ScheduleConfigError(
                f"CostModel.per_microbatch[{j}] must be a positive finite number (microbatch "
                f"{j}'s compute relative to the model's costs), got {factor!r}"
            )
    return factors


def _overrides(value: Mapping | None) -> Mapping[int, CostModel]:
    table = dict(value or {})
    for key, model in table.items():
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise ScheduleConfigError(f"CostModel override keys must be indices >= 0, got {key!r}")
        if not isinstance(model, CostModel):
            raise ScheduleConfigError(
                f"CostModel override for {key} must be a CostModel, got {model!r}"
            )
    return MappingProxyType(table)


# [Note: segment costs] What a segment costs is the segment's: the embedding's, the LM head's.
# Per-stage costs mean it for the placement they were measured in only: a V puts the first and
# the last segments on stage 0, and stage costs read in tune's units ([Note: tune's units]) would
# price each of its chunks at the average of whatever that stage ran in the trace, and a cut in
# p from a trace cut in 2p would add up segments k and k + p rather than 2k and 2k + 1. So costs
# may come per segment of one replica (`per_segment`; `from_trace` reads them through the
# trace's cut record), and `placed` resolves them onto a program: at the same cut, each segment
# its own wherever it lies; at a coarser one (the model cut in fewer, larger segments), each its
# segments' sum, as exact as the trace (a merged boundary's comm is not a compute); at a finer
# one, no split is known (the head lies in one half only), so the per-stage costs in tune's units
# price it as before. Traces of other cuts of the same model add their own tables
# (`other_segments`, through `from_trace`'s `other_cuts`): a program at one of their cuts reads
# its segments from that run's. Comm, reduce and update costs stay per stage.
def _segments(
    value: Iterable[CostModel] | None, name: str = "per_segment"
) -> tuple[CostModel, ...]:
    """`per_segment` (or the table `name`) as a tuple of `CostModel`s (a
    `ScheduleConfigError` else)."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, Mapping, CostModel)) or not isinstance(value, Iterable):
        raise ScheduleConfigError(
            f"CostModel.{name} must be a sequence of CostModels, one per segment of the "
            f"model, got {value!r}"
        )
    models = tuple(value)
    for k, model in enumerate(models):
        if not isinstance(model, CostModel):
            raise ScheduleConfigError(f"CostModel.{name}[{k}] must be a CostModel, got {model!r}")
    return models


def _tables(value: Iterable[Iterable[CostModel]] | None) -> tuple[tuple[CostModel, ...], ...]:
    """`other_segments` as a tuple of `per_segment` tables (a `ScheduleConfigError` else)."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, Mapping, CostModel)) or not isinstance(value, Iterable):
        raise ScheduleConfigError(
            f"CostModel.other_segments must be a sequence of per_segment tables, got {value!r}"
        )
    return tuple(_segments(table, f"other_segments[{k}]") for k, table in enumerate(value))


@attrs.frozen(slots=True, eq=True, hash=False)
class CostModel:
    """Durations of each instruction kind, in any consistent unit (default: a forward is 1).

    Args:
        forward, backward, backward_input, backward_weight: compute costs (F, B, I, W).
        comm: the cost of one comm group (a batched exchange), on top of waiting for the peer;
            in the eager timeline, a message's flight, taken from neither stage.
        receive: what the receiving stage spends taking one message that has come (unpacking
            it) before the compute that first needs it, on its own time: added to that compute
            ([Note: a receive's take]). `from_trace` measures it.
        reduce: a `ReduceGrads` (all-reduce, or reduce-scatter under ZeRO), or a `ReduceTied`
            (the all-reduce of a tied group's gradients, once its members are all there).
        norm: a `GradNorm` (one scalar all-reduce over every stage, once they are all there:
            the optimizer's synchronisation that global gradient clipping needs).
        step: an `OptimizerStep`.
        gather: a `GatherParams` (ZeRO-1's all-gather) or an `Unshard` (ZeRO-3's).
        overlap: the part of the shorter computation of an overlapped forward/backward pair
            (`F3.1 +B1`) that overlapping does not hide: the pair takes `max(F, B) + overlap *
            min(F, B)`. The default 0.5 is a middle guess between perfect overlap (0: the
            pair costs its longer half) and none (1: `F + B`); measure yours and set it.
        release: a `Reshard` (ZeRO-3 dropping a chunk's gathered parameters).
        recompute: a `Recompute` (None: the same as this model's `forward`).
        offload, reload: an `Offload` and a `Reload`, on the stage's copy lane: they overlap
            the stage's computes but not each other, and a backward piece waits for its
            reload ([Note: offloading] in `schedcc.rules.offload`).
        warmup_forward, warmup_backward: what a stage's first forward, and its first backward
            (B, I or an overlapped pair's), of a run of the program take beyond their cost:
            after the optimizer step a stage's caches are cold and its buffers unallocated
            ([Note: a step's first computes]); whatever the chunk, not scaled by
            `per_microbatch`. `from_trace` measures them.
        warmup_receive: what a stage's first take of a run of the program takes beyond
            `receive`, added to the compute that first takes a message on that stage, of
            whatever chunk ([Note: a receive's take]). `from_trace` measures it.
        fixed_forward, fixed_backward: the part of each forward (and `Recompute`), and of each
            B, I and W, that does not shrink with its chunk (the runtime's own work around the
            segment's): part of those costs, not added to them. Pricing a stage's costs at v
            chunks, or merging measured segments, divides only the rest ([Note: a compute's
            fixed time], `fixed_share`). `from_trace` measures them.
        memory: bytes per segment (`schedcc.MemoryModel`), for `Timeline.peak_bytes`
            and `Timeline.peak_activation_bytes`; read from the top-level model only.
        per_stage: `{stage: CostModel}`; that stage reads its costs from the given model.
        per_chunk: `{chunk: CostModel}`; computes on that chunk read from the given model.
        per_segment: one `CostModel` per segment of one model replica, in model order, whose
            compute and copy costs (`CHUNK_FIELDS`) are that segment's own: what a run
            measured of each (`from_trace` sets them) or what you know of each (the segment
            holding an LM head). A program cutting a replica in as many segments reads segment
            `k`'s from `per_segment[k]` wherever its placement puts it (looped, V, DualPipe's
            second replica); one cutting it in fewer reads each of its segments as the sum of
            the ones it merges; another cut reads the per-stage costs ([Note: segment costs]).
            Read from the top-level model only; they take precedence over `per_stage` and
            `per_chunk` for those fields.
        other_segments: more `per_segment` tables, each of another cut of the same model
            (`from_trace` sets them from its `other_cuts`): a program cutting a replica in
            exactly as many segments as one of them holds reads its segments from that one
            (each as that cut's run measured it), any other from `per_segment` ([Note:
            segment costs]). Read from the top-level model only, with `per_segment`.
        per_microbatch: one factor per microbatch of a batch (`m` of them, e.g. its samples
            or tokens relative to the mean): a compute of microbatch `i` costs what the model
            says times `per_microbatch[i % m]` (microbatches of unequal size, see
            `schedcc.microbatches`); comm and updates are not scaled. An overlapped pair's
            forward takes its factor and the backward's rest (`overlapped_pair`) takes the
            backward's. Read from the top-level model only; the simulators refuse another
            count than the program's `m`. Empty (the default): every microbatch alike.

    Resolution, most specific first: `per_stage[s].per_chunk[c]`, `per_stage[s]`,
    `per_chunk[c]`, then this model's own fields. A comm group reads the model of its first op.
    `per_segment` is resolved onto a program's placement first (`placed`; `schedcc.simulate`,
    `tune` and `search` do it).

    Raises:
        ScheduleConfigError: a negative or non-numeric cost, or a malformed override.

    >>> slow_last = CostModel(per_stage={3: CostModel(forward=2.0, backward=4.0)})
    >>> slow_last.at(3).forward, slow_last.at(0).forward
    (2.0, 1.0)
    """

    forward: float = attrs.field(default=1.0, validator=_non_negative)
    backward: float = attrs.field(default=2.0, validator=_non_negative)
    backward_input: float = attrs.field(default=1.0, validator=_non_negative)
    backward_weight: float = attrs.field(default=1.0, validator=_non_negative)
    comm: float = attrs.field(default=0.0, validator=_non_negative)
    receive: float = attrs.field(default=0.0, validator=_non_negative)
    reduce: float = attrs.field(default=0.0, validator=_non_negative)
    step: float = attrs.field(default=0.0, validator=_non_negative)
    norm: float = attrs.field(default=0.0, validator=_non_negative)
    gather: float = attrs.field(default=0.0, validator=_non_negative)
    release: float = attrs.field(default=0.0, validator=_non_negative)
    recompute: float | None = attrs.field(default=None, validator=_optional)
    offload: float = attrs.field(default=0.0, validator=_non_negative)
    reload: float = attrs.field(default=0.0, validator=_non_negative)
    memory: MemoryModel | None = attrs.field(default=None, validator=_memory_model)
    overlap: float = attrs.field(default=0.5, validator=_fraction)
    warmup_forward: float = attrs.field(default=0.0, validator=_non_negative)
    warmup_backward: float = attrs.field(default=0.0, validator=_non_negative)
    warmup_receive: float = attrs.field(default=0.0, validator=_non_negative)
    fixed_forward: float = attrs.field(default=0.0, validator=_non_negative)
    fixed_backward: float = attrs.field(default=0.0, validator=_non_negative)
    per_stage: Mapping[int, CostModel] = attrs.field(factory=dict, converter=_overrides)
    per_chunk: Mapping[int, CostModel] = attrs.field(factory=dict, converter=_overrides)
    per_microbatch: tuple[float, ...] = attrs.field(default=(), converter=_factors)
    per_segment: tuple[CostModel, ...] = attrs.field(default=(), converter=_segments)
    other_segments: tuple[tuple[CostModel, ...], ...] = attrs.field(default=(), converter=_tables)

    def at(self, stage: int, chunk: int = 0) -> CostModel:
        """The model that applies to `chunk` on `stage` (see the resolution order above)."""
        model = self.per_stage.get(stage)
        if model is not None:
            return model.per_chunk.get(chunk, model)
        return self.per_chunk.get(chunk, self)

    def cost(self, stage: int, op: Instruction) -> float:
        """The duration of `op` on `stage` (comm ops: the group cost), a compute scaled by its
        microbatch's `per_microbatch` factor.

        >>> CostModel(per_microbatch=[1, 3]).cost(0, parse("F3")), CostModel().cost(0, parse("B3"))
        (3.0, 2.0)
        """
        cost = kind_cost(self.at(stage, getattr(op, "chunk", 0)), type(op))
        if self.per_microbatch and isinstance(op, COMPUTE):
            cost *= self.per_microbatch[op.microbatch % len(self.per_microbatch)]
        return cost

    def placed(self, place: Sequence[tuple[int, int]], cut: int | None = None) -> CostModel:
        """This model with `per_segment` resolved onto a program's placement: `place[k]` is
        segment `k`'s `(stage, chunk)` and `cut` how many segments one model replica is cut
        in (default: all of them; segment `k` is a copy of the replica's `k % cut`). Each
        segment's compute and copy costs become `per_stage[s].per_chunk[c]`'s, from its own
        model or the sum of those it merges (less their fixed parts but one: `fixed_merge`),
        from the table of `other_segments` that holds `cut` segments where one does; at a cut
        `per_segment` does not divide into, nothing changes but `per_segment` dropping ([Note:
        segment costs]).

        >>> head = CostModel(forward=3.0, backward=6.0)
        >>> costs = CostModel(per_segment=[CostModel(), CostModel(), CostModel(), head])
        >>> v_shape = costs.placed([(0, 0), (1, 0), (1, 1), (0, 1)])  # stage 0 holds the head
        >>> v_shape.at(0, 1).forward, v_shape.at(1, 1).forward
        (3.0, 1.0)
        >>> costs.placed([(0, 0), (1, 0)]).at(1).forward  # two segments merged a stage
        4.0
        """
        if not self.per_segment:
            return self
        base = attrs.evolve(self, per_segment=(), other_segments=())
        cut = len(place) if cut is None else cut
        segments = next(
            (table for table in self.other_segments if len(table) == cut), self.per_segment
        )
        if not 0 < cut <= len(segments) or len(segments) % cut:
            return base
        merge = len(segments) // cut
        own = [  # each of a replica's segments: the compute and copy costs of those it merges
            {
                field: [kind_cost(model, cls) for model in segments[j * merge : (j + 1) * merge]]
                for cls, field in _FIELD.items()
                if field in CHUNK_FIELDS
            }
            for j in range(cut)
        ]
        chunks: dict[int, dict[int, CostModel]] = {}
        for k, (stage, chunk) in enumerate(place):
            model = _bare(base.at(stage, chunk))
            merged = {  # less the fixed parts they merge: [Note: a compute's fixed time]
                field: fixed_merge(model, field, costs) for field, costs in own[k % cut].items()
            }
            chunks.setdefault(stage, {})[chunk] = attrs.evolve(model, **merged)
        per_stage = dict(base.per_stage)
        for stage, models in chunks.items():
            per_stage[stage] = attrs.evolve(
                _bare(base.per_stage.get(stage, base)), per_chunk=models
            )
        return attrs.evolve(base, per_stage=per_stage)

    def check_microbatches(self, num_microbatches: int) -> None:
        """Raise unless `per_microbatch` is empty or gives `num_microbatches` factors.

        Raises:
            ScheduleConfigError: another count, naming both.
        """
        given = len(self.per_microbatch)
        if given and given != num_microbatches:
            raise ScheduleConfigError(
                f"CostModel.per_microbatch gives {given} factors but the program has m="
                f"{num_microbatches} microbatches per batch: give one factor per microbatch"
            )

    @classmethod
    def from_trace(
        cls,
        trace: str | PathLike | Mapping | Iterable[Mapping],
        *,
        unit_us: float = 1000.0,
        num_stages: int | None = None,
        other_cuts: Iterable[str | PathLike | Mapping | Iterable[Mapping]] = (),
        **defaults: float,
    ) -> CostModel:
        """Costs measured in a run: the median duration of each instruction kind, per stage.

        Args:
            trace: a Chrome trace file (a JSON list, or an object with "traceEvents"), that
                object parsed (its "otherData" read as a file's), or its events. Complete
                events ("ph": "X") whose name parses as an instruction (`F3.1`, `B0`,
                `Reduce`, ...) count; the stage is their `pid` when the events span several
                pids (a process per stage), else their `tid`; `dur` is the duration in
                microseconds. A comm op's duration includes any wait for its peer; where a
                receive records its take (`"take_us"`, as `schedcc run --trace` writes it),
                that is a sample of `receive` and not of `comm` ([Note: a receive's take]).
            unit_us: microseconds per cost unit: 1000 reads back what `to_chrome_trace` wrote
                (1 ms per unit); 1e6 gives seconds.
            num_stages: the stages the trace must measure, 0 to `num_stages - 1` (a stage's
                costs depend on how the model was cut: a trace of another depth is refused);
                None: any.
            other_cuts: traces of runs of the same model at other cuts (another v, the same
                stages): each stage's `fixed_forward` and `fixed_backward` are read off how the
                sum of its computes grows with their count ([Note: a compute's per-call
                time]), and where they record their cut, each segment's compute costs at that
                cut (`other_segments`); the rest is `trace`'s alone.
            defaults: fields for kinds the trace does not show (e.g. `comm=0.1`). Without
                one, a backward the trace shows only whole or only split is read both ways
                ([Note: a trace's backward both ways]), and a trace of a run on the CPU
                (`"otherData": {"device": "cpu"}`, as `schedcc run --trace` writes it) gives
                `overlap=1.0`: the CPU backends run an overlapped pair's halves in order.

        Raises:
            ScheduleConfigError: the file is not JSON or not a trace, an instruction event has
                a non-numeric `dur` or stage, no event names an instruction, or the stages are
                not `num_stages`'.
            OSError: the file cannot be read.
        """
        read = _read(trace, unit_us, num_stages)
        samples, timed, metadata, replicas = read
        if metadata.get("device") == "cpu":
            defaults = {"overlap": 1.0, **defaults}
        warm = _warmups(timed, samples, replicas)  # [Note: a step's first computes]
        for stage, excess in _first_takes(timed, samples).items():  # [Note: a receive's take]
            warm.setdefault(stage, {})["warmup_receive"] = excess
        fixed = _fixed(timed, defaults)  # [Note: a compute's fixed time]
        others = []
        for other in other_cuts:  # [Note: a compute's per-call time]
            others.append(_read(other, unit_us, num_stages or len(samples)))
            _same_run(read, others[-1], other)
        if others:
            fixed = _per_call([read, *others], fixed, defaults)

        def model(kinds, share: int, fixed_parts: Mapping[str, float], **more) -> CostModel:
            """The model of `kinds`' samples, its chunks summed over `share` replicas, with
            `fixed_parts` and the caller's defaults."""
            fields = {**defaults, **fixed_parts}
            measured = _both_ways(_medians(kinds, share, fields), defaults, fields)
            return cls(**{**fields, **measured}, **more)

        per_stage = {
            stage: model(
                kinds,
                replicas,
                fixed.get(stage, {}),
                **{f: v for f, v in warm.get(stage, {}).items() if f not in defaults},
            )
            for stage, kinds in samples.items()
        }
        overall: dict[tuple[str, int], list[float]] = {}
        for kinds in samples.values():
            for key, values in kinds.items():
                overall.setdefault(key, []).extend(values)
        per_segment, *other_segments = (
            [model(kinds, 1, fixed.get(None, {})) for kinds in _by_segment(*each)]
            for each in [
                (samples, metadata.get("cut")),
                *((other.samples, other.metadata.get("cut")) for other in others),
            ]
        )
        return model(
            overall,
            replicas,
            fixed.get(None, {}),
            per_stage=per_stage,
            per_segment=per_segment,
            other_segments=[table for table in other_segments if per_segment and table],
        )


class _Read(NamedTuple):
    """A trace as `CostModel.from_trace` reads it: each stage's samples by (kind, chunk), the
    timed instructions they come from, the trace's metadata and its model replicas."""

    samples: dict[int, dict[tuple[str, int], list[float]]]
    timed: list[_Sample]
    metadata: Mapping
    replicas: int


def _read(
    trace: str | PathLike | Mapping | Iterable[Mapping], unit_us: float, num_stages: int | None
) -> _Read:
    """`trace`'s samples (`CostModel.from_trace`'s arguments; its errors)."""
    events, metadata = read_chrome_trace(trace)
    replicas = _replicas(metadata.get("cut"))
    found = [(event, kind) for event in events if (kind := _kind_of(event)) is not None]
    by_pid = len({event.get("pid", 0) for event, _ in found}) > 1
    timed: list[_Sample] = []
    for event, (kind, chunk) in found:
        try:
            track = int(event.get("pid", 0) if by_pid else event.get("tid", 0))
            stage = track if by_pid else track_stage(track)
            duration = float(event["dur"]) / unit_us
            start = float(event.get("ts", 0)) / unit_us
        except (TypeError, ValueError):
            raise ScheduleConfigError(
                f"trace event {event.get('name')!r}: its dur, ts, pid and tid must be numbers"
            ) from None
        meets = kind in ("reduce", "norm") and isinstance(parse(event["name"]), _MEETS)
        meet = event["name"] if meets else None
        own = _own_time(event, unit_us, "segment_us") if kind in FIXED_OF else None
        if kind == "comm":  # [Note: a receive's take]
            own = _own_time(event, unit_us, "take_us")
        timed.append(_Sample(stage, track, start, kind, chunk, duration, meet, own))
    timed = _after_meeting(timed)
    if metadata.get("measured") is True:
        timed = _unpaired(timed)
    timed = _taken(timed)  # [Note: a receive's take]
    samples: dict[int, dict[tuple[str, int], list[float]]] = {}
    for t in timed:
        kind = "backward" if t.kind == _PAIRED else t.kind  # a simulated pair's rest
        samples.setdefault(t.stage, {}).setdefault((kind, t.chunk), []).append(t.duration)
    if not samples:
        raise ScheduleConfigError(
            "the trace has no complete ('X') events named like instructions (F3, B3.1, ...)"
        )
    if num_stages is not None and sorted(samples) != list(range(num_stages)):
        where = trace if isinstance(trace, (str, PathLike)) else "the trace"
        raise ScheduleConfigError(
            f"{where} measured stages {sorted(samples)}, not the {num_stages} of this "
            f"pipeline (a stage's costs depend on the cut): trace a run with -p {num_stages}"
        )
    return _Read(samples, timed, metadata, replicas)


def _bare(model: CostModel) -> CostModel:
    """`model`'s own fields, without its overrides and memory."""
    return attrs.evolve(
        model, per_stage={}, per_chunk={}, per_segment=(), other_segments=(), memory=None
    )


def measured_backward(trace: str | PathLike | Iterable[Mapping]) -> tuple[bool, ...]:
    """The backward forms a search may price from a trace, as `schedcc.search`'s
    `split_backward` takes them: `(False,)` where it measured whole backwards only (input and
    weight gradients read off them are optimistic: [Note: a trace's backward both ways]), else
    both (a whole backward read as I + W is priced high, if anything: one pass costs no more
    than the two).

    Raises:
        ScheduleConfigError: the file is not JSON or not a trace.
        OSError: the file cannot be read.
    """
    events, _ = read_chrome_trace(trace)
    kinds = {kind for event in events if (kind := _kind_of(event)) is not None}
    whole = any(k in ("backward", _PAIRED) for k, _ in kinds)
    split = any(k in ("backward_input", "backward_weight") for k, _ in kinds)
    return (False,) if whole and not split else (False, True)


# [Note: a trace's updates] The updates a run compiled cost what its trace measured of them:
# the collectives of its tied groups (`ReduceTied`, priced `reduce`) and of the gradient norm
# (`GradNorm`, `norm`), 5-15% of a step for the tied-head GPT on the CPU. An order searched or
# ranked without them is timed for another program than the one that runs, faster by their
# cost. So `schedcc run --trace` records them ("otherData" -> "updates": the tied groups within
# one model replica of its cut, and whether it took the norm), and the closed loop, `search
# --costs-from` and `tune --costs-from` compile every order with them (`measured_updates`). A
# tie of the first and last segments (the embedding and the LM head) holds at every cut, and is
# read as `(0, -1)`; a tie of other segments names segments of the trace's cut only.
@attrs.frozen
class MeasuredUpdates:
    """The updates a traced run compiled ([Note: a trace's updates]): its `tied` groups, the
    first segment 0 and the last -1 (any other index one of the segments of `cut`), whether it
    took the gradient norm (`grad_norm`), and the segments of one model replica it was cut in
    (`cut`)."""

    tied: tuple[tuple[int, ...], ...] = ()
    grad_norm: bool = False
    cut: int | None = None

    @property
    def cut_free(self) -> bool:
        """Whether `tied` names the same segments at every cut (only 0 and -1)."""
        return all(k <= 0 for group in self.tied for k in group)


def measured_updates(trace: str | PathLike | Mapping | Iterable[Mapping]) -> MeasuredUpdates:
    """The updates the run a trace times compiled (none where it records none: a simulated
    trace, or one of another tool).

    Raises:
        ScheduleConfigError: the file is not a trace, or its record is malformed.
        OSError: the file cannot be read.
    """
    _, metadata = read_chrome_trace(trace)
    record = metadata.get("updates")
    if record is None:
        return MeasuredUpdates()
    cut = metadata.get("cut")
    try:
        length = cut["num_stages"] * cut["num_chunks"] // _replicas(cut)
        groups, grad_norm = record["tied"], record["grad_norm"]
    except (KeyError, TypeError):
        groups = grad_norm = None
    if not (_rows_of_ints(groups) and isinstance(grad_norm, bool)):
        raise ScheduleConfigError(
            "trace: its updates record must give tied (groups of segment indices) and grad_norm "
            f"(a boolean), and its cut record the stages and chunks; got {record!r}, {cut!r}"
        )

    def named(k: int) -> int:  # the last segment as -1, the first 0, and the others as cut
        return -1 if 0 < k == length - 1 else k

    tied = tuple(tuple(sorted(map(named, g), key=lambda k: (k < 0, k))) for g in groups)
    return MeasuredUpdates(tied, grad_norm, length)


# [Note: a trace's backward both ways] A run of F/B orders measures whole backwards only, one of
# F/I/W orders input and weight gradients only; a search over both forms needs both. Left at the
# default 1.0 the missing kind is a fiction (a 1F1B trace with B = 8 ms gave I = W = 1 ms, and
# the search chose F/I/W orders that measured far slower than simulated). So the missing form is
# read off the measured one: I = W = B / 2 (a linear layer's two gradients are matrix products of
# the same size, the zero-bubble paper's I = W), and B = I + W. A kind the caller gives wins.
# Read so, the missing form is still a guess, and an optimistic one on the CPU engines: with a
# 1F1B trace, the F/I/W orders the search chose measured 8-20% slower than the F/B orders it found
# for the same costs in 6 of 7 shapes (docs/performance.md, "Backward forms"). So the closed loop,
# and `schedcc search --costs-from` unless `--backward` says otherwise, search F/B orders only
# after a trace of whole backwards (`measured_backward`); after one of split backwards, both (B =
# I + W is the pessimistic side: one pass costs no more than the two).
def _both_ways(
    measured: dict[str, float], defaults: Mapping[str, float], fields: Mapping[str, float]
) -> dict[str, float]:
    """`measured` with the backward form it lacks read off the other (each compute's fixed
    part in `fields`' `fixed_backward`, [Note: a compute's fixed time])."""
    out = dict(measured)
    split = ("backward_input", "backward_weight")
    model = CostModel(fixed_backward=fields.get("fixed_backward", 0.0))
    if "backward" in out and not any(k in out or k in defaults for k in split):
        out.update(dict.fromkeys(split, fixed_share(model, "backward", out["backward"], 2)))
    elif all(k in out for k in split) and "backward" not in out and "backward" not in defaults:
        out["backward"] = fixed_merge(model, "backward", [out[k] for k in split])
    return out


def _kind_of(event: object) -> tuple[str, int] | None:
    """The cost field an event measures and, for a chunk's compute or copy, its chunk (0 for
    the others)."""
    if not isinstance(event, Mapping) or event.get("ph") != "X" or "dur" not in event:
        return None
    try:
        op = parse(str(event.get("name", "")))
    except ValueError:
        return None
    if isinstance(op, Comm):
        return "comm", 0
    # an overlapped pair's backward is read as a backward ([Note: a measured pair])
    kind = _PAIRED if isinstance(op, OverlappedBackward) else _FIELD[type(op)]
    return kind, op.chunk if kind in CHUNK_FIELDS or kind == _PAIRED else 0


#: The kind `_kind_of` gives an overlapped pair's backward (`+B1`), read as a backward.
_PAIRED = "paired backward"


# [Note: a measured pair] The engines run an overlapped pair `F3 +B1` at its `OverlappedBackward`
# ([Note: running an overlapped pair] in `backends/runtime/handlers.py`): a run's trace times the
# forward's event as a marker (microseconds) and the `+B1` event as the whole pair, the forward
# then the backward. A simulated trace times each half as the simulator prices it (the forward
# its cost, `+B1` the rest of the pair, `overlapped_pair`). So in a measured trace (`"measured":
# true`, as `schedcc run --trace` writes it) a paired forward is no sample of a forward, and the
# pair, less the median unpaired forward of its forward's chunk on that stage, is a sample of
# the backward (dropped where no unpaired forward of that chunk was measured); in a simulated
# one `+B1` is read as a backward as it is. Read as forwards, DualPipe-V's markers made its
# forwards 0.01 ms where they take 2 ms, and its backwards F + B.
class _Sample(NamedTuple):
    """One timed instruction of a trace: its stage and track, start, cost field and chunk, and
    its duration in cost units."""

    stage: int
    track: int
    start: float
    kind: str
    chunk: int
    duration: float
    meet: str | None = None  # a collective's name (`Tied0`, `Norm`): its members meet
    own: float | None = None  # a compute's time in its segment's own work, a receive's take


#: The collectives the stages of one pipeline meet at.
_MEETS = (ReduceTied, GradNorm)


# [Note: a collective's wait] A `ReduceTied` or `GradNorm` starts on each stage of its group
# when that stage gets to it and ends once every member has arrived and the collective has run,
# so its measured duration holds the wait for the last member: at the end of a step, most of
# it. The simulators start a collective once its members are all there and end it on each stage
# its cost later, so a member's cost is its end less the last member's start, the k-th
# occurrence of one name on each stage being one collective (a trace of one pipeline replica;
# a `ReduceGrads` meets other replicas, which it does not show, and is read as it is). In a
# simulated trace the members start together, and this reads each duration back as it is.
def _after_meeting(timed: list[_Sample]) -> list[_Sample]:
    """`timed` with each collective's duration counted from its last member's start."""
    occurrences: dict[tuple[str, int], list[_Sample]] = {}
    for t in sorted(timed, key=lambda t: t.start):
        if t.meet is not None:
            occurrences.setdefault((t.meet, t.stage), []).append(t)
    met: dict[_Sample, _Sample] = {}
    for name in {name for name, _ in occurrences}:
        rows = [row for (n, _), row in occurrences.items() if n == name]
        for members in zip(*rows):
            last = max(t.start for t in members)
            for t in members:
                met[t] = t._replace(duration=max(t.start + t.duration - last, 0.0))
    return [met.get(t, t) for t in timed]


def _warmups(
    timed: list[_Sample],
    samples: Mapping[int, Mapping[tuple[str, int], list[float]]],
    replicas: int,
) -> dict[int, dict[str, float]]:
    """Per stage, `warmup_forward` and `warmup_backward` as the trace shows them, in a stage's
    units ([Note: a trace's cut]): over its runs on each track (split after each `step`), per
    chunk the median of its first forward's duration less its median forward (none below 0),
    summed over the stage's chunks and divided by the model replicas; likewise the first
    backwards ([Note: a step's first computes])."""
    fields = {"forward": "warmup_forward", "backward": "warmup_backward"}
    fields.update({"backward_input": "warmup_backward", _PAIRED: "warmup_backward"})
    excess: dict[int, dict[tuple[str, int], list[float]]] = {}
    seen: dict[int, set[tuple[str, int]]] = {}
    for t in sorted(timed, key=lambda t: (t.track, t.start)):
        if t.kind == "step":
            seen[t.track] = set()  # the next run on this track
            continue
        field = fields.get(t.kind)
        if field is None or (field, t.chunk) in seen.setdefault(t.track, set()):
            continue
        seen[t.track].add((field, t.chunk))
        kind = "backward" if t.kind == _PAIRED else t.kind
        usual = statistics.median(samples[t.stage][kind, t.chunk])
        excess.setdefault(t.stage, {}).setdefault((field, t.chunk), []).append(t.duration - usual)
    out: dict[int, dict[str, float]] = {}
    for stage, row in excess.items():
        for (field, _), values in row.items():
            warm = max(float(statistics.median(values)), 0.0) / replicas
            out.setdefault(stage, {})[field] = out.get(stage, {}).get(field, 0.0) + warm
    return out


def _first_takes(
    timed: list[_Sample], samples: Mapping[int, Mapping[tuple[str, int], list[float]]]
) -> dict[int, float]:
    """Per stage, `warmup_receive` as the trace shows it: over its runs on each track (split
    after each `step`), the median of its first take less its median take, none below 0
    ([Note: a receive's take])."""
    excess: dict[int, list[float]] = {}
    taken: set[int] = set()
    for t in sorted(timed, key=lambda t: (t.track, t.start)):
        if t.kind == "step":
            taken.discard(t.track)  # the next run on this track
        elif t.kind == "receive" and t.track not in taken:
            taken.add(t.track)
            usual = statistics.median(samples[t.stage]["receive", 0])
            excess.setdefault(t.stage, []).append(t.duration - usual)
    return {stage: max(float(statistics.median(v)), 0.0) for stage, v in excess.items()}


def _unpaired(timed: list[_Sample]) -> list[_Sample]:
    """A measured trace's samples with each overlapped pair read as its backward ([Note: a
    measured pair])."""
    ordered = sorted(timed, key=lambda t: (t.track, t.start))
    computes = [t for t in ordered if t.kind != "comm"]
    paired = {  # a pair's backward -> its forward (the marker just before it on its track)
        after: before
        for before, after in pairwise(computes)
        if after.kind == _PAIRED and before.kind == "forward" and before.track == after.track
    }
    markers = set(paired.values())
    forwards: dict[tuple[int, int], list[float]] = {}
    for t in ordered:
        if t.kind == "forward" and t not in markers:
            forwards.setdefault((t.stage, t.chunk), []).append(t.duration)
    out = []
    for t in ordered:
        if t in markers:
            continue
        if t.kind == _PAIRED:
            forward = paired.get(t)
            alone = forwards.get((t.stage, forward.chunk)) if forward is not None else None
            if not alone:
                continue  # no forward known to take off the pair
            rest = max(t.duration - statistics.median(alone), 0.0)
            t = t._replace(kind="backward", duration=rest, own=None)
        out.append(t)
    return out


# [Note: a trace's cut] Costs are a stage's share of the model at v = 1 ([Note: tune's units]),
# and a run at v chunks a stage times each chunk's computes apart, each on its part of that
# share. So a trace is read back in those units: a stage's cost of a chunk's kind (computes,
# copies) is the sum of its chunks' medians, the whole share, divided by the model replicas the
# trace's cut record gives ("otherData" -> "cut", as `schedcc run --trace` writes it; DualPipe's
# two chunks each run a replica's whole share, 1 without the record); comm and update kinds are
# one median. At v = 1 it is each kind's median.
def _replicas(cut: object) -> int:
    """How many model replicas a trace's `cut` record says its run held (1 without one)."""
    if cut is None:
        return 1
    replicas = cut.get("num_replicas") if isinstance(cut, Mapping) else None
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ScheduleConfigError(
            f"trace: its cut record must give num_replicas, a positive integer; got {cut!r}"
        )
    return replicas


def _by_segment(
    samples: Mapping[int, Mapping[tuple[str, int], list[float]]], cut: object
) -> list[dict[tuple[str, int], list[float]]]:
    """A trace's compute and copy samples per segment of one model replica, through its cut
    record's segment table ("segments": stage s's chunk c ran segment `segments[s][c]`, a copy
    of the replica's `% (p * v / R)`); none without one ([Note: segment costs])."""
    table = cut.get("segments") if isinstance(cut, Mapping) else None
    if table is None:
        return []
    flat = [k for row in table for k in row] if _rows_of_ints(table) else []
    replicas = _replicas(cut)
    if sorted(flat) != list(range(len(flat))) or not flat or len(flat) % replicas:
        raise ScheduleConfigError(
            "trace: its cut record's segments must list each stage's segments, every one of "
            f"0..p*v-1 once, a multiple of num_replicas in all; got {table!r}"
        )
    length = len(flat) // replicas
    out: list[dict[tuple[str, int], list[float]]] = [{} for _ in range(length)]
    for stage, kinds in samples.items():
        for (kind, chunk), values in kinds.items():
            if kind not in CHUNK_FIELDS:
                continue
            if not (stage < len(table) and chunk < len(table[stage])):
                raise ScheduleConfigError(
                    f"trace: stage {stage} ran chunk {chunk}, which its cut record's segments "
                    f"{table!r} do not place"
                )
            segment = out[table[stage][chunk] % length]
            segment.setdefault((kind, 0), []).extend(values)
    return out


def _rows_of_ints(table: object) -> bool:
    return isinstance(table, list) and all(
        isinstance(row, list) and all(isinstance(k, int) and not isinstance(k, bool) for k in row)
        for row in table
    )


def _medians(
    kinds: Mapping[tuple[str, int], list[float]], replicas: int, fields: Mapping[str, float]
) -> dict[str, float]:
    """Each field's cost in a stage's units ([Note: a trace's cut]): per chunk a median, the
    chunks of a chunk's kind summed over the replicas, as one compute: their fixed parts but
    one left out (`fields`' `fixed_forward` and `fixed_backward`, [Note: a compute's fixed
    time])."""
    chunks: dict[str, list[float]] = {}
    for (kind, _), values in sorted(kinds.items()):
        chunks.setdefault(kind, []).append(float(statistics.median(values)))
    out: dict[str, float] = {}
    for kind, medians in chunks.items():
        if kind not in CHUNK_FIELDS:
            out[kind] = sum(medians)
            continue
        fixed = min(fields.get(FIXED_OF[kind], 0.0), *medians) if kind in FIXED_OF else 0.0
        out[kind] = sum(value - fixed for value in medians) / replicas + fixed
    return out


def _own_time(event: Mapping, unit_us: float, field: str) -> float | None:
    """A measured event's own time in cost units, `field` in its args: a compute's in its
    segment's own work (`"segment_us"`, [Note: a compute's own time]), a receive's in taking its
    message (`"take_us"`, [Note: a receive's take]); None without one."""
    args = event.get("args")
    own = args.get(field) if isinstance(args, Mapping) else None
    if own is None:
        return None
    if isinstance(own, bool) or not isinstance(own, (int, float)) or not own >= 0:
        raise ScheduleConfigError(
            f"trace event {event.get('name')!r}: its {field} must be a number >= 0, got {own!r}"
        )
    return float(own) / unit_us


def _taken(timed: list[_Sample]) -> list[_Sample]:
    """`timed` with each comm op's duration less its comm group's takes (the ops of a group
    share its span), and each receive's take a sample of `receive` ([Note: a receive's
    take])."""
    groups: dict[tuple[int, float, float], float] = {}
    for t in timed:
        if t.kind == "comm" and t.own is not None:
            key = (t.track, t.start, t.duration)
            groups[key] = groups.get(key, 0.0) + t.own
    if not groups:
        return timed
    out = []
    for t in timed:
        if t.kind == "comm":
            if t.own is not None:
                out.append(t._replace(kind="receive", duration=t.own, own=None))
            taken = groups.get((t.track, t.start, t.duration), 0.0)
            t = t._replace(duration=max(t.duration - taken, 0.0), own=None)
        out.append(t)
    return out


def _fixed(timed: list[_Sample], defaults: Mapping[str, float]) -> dict[int | None, dict]:
    """Per stage (and over them all, None), `fixed_forward` and `fixed_backward` as the trace
    shows them: the median of each compute's duration less its own time, over the computes
    that record one; none below 0, none the caller gives ([Note: a compute's fixed time])."""
    rests: dict[int | None, dict[str, list[float]]] = {}
    for t in timed:
        if t.own is None or t.kind not in FIXED_OF:
            continue
        rest = max(t.duration - t.own, 0.0)
        for key in (t.stage, None):
            rests.setdefault(key, {}).setdefault(FIXED_OF[t.kind], []).append(rest)
    return {
        key: {
            field: float(statistics.median(values))
            for field, values in row.items()
            if field not in defaults
        }
        for key, row in rests.items()
    }


# [Note: a compute's per-call time] The runtime's work is not all of what a compute costs
# whatever its chunk: a segment's own call has a part that does not shrink with it either (its
# modules' dispatch, a smaller matrix product's lower efficiency). tiny-gpt at p = 2 on the CPU:
# a stage's forwards at v = 2, summed over its two chunks, took 3-15% more than its one forward
# at v = 1, more than the runtime's part accounts for. One cut's trace cannot tell that part
# from the rest; two cuts of the same model can. A stage running its share as k computes per
# model replica takes `S(k) = a + k * g` summed over them, `g` the part each call costs whatever
# its chunk: so `from_trace(trace, other_cuts=[...])` reads `g` per stage as the slope of the
# least-squares line through each trace's `(k, S)` (of the forwards for `fixed_forward`, and of
# the first of B, I and W that two cuts measured for `fixed_backward`), no less than the
# runtime's part `trace` measured and no more than a compute's cost, and reads `trace` with it.
# Runs of two cuts are best traced back to back: on a shared machine a run's speed drifts, and
# the drift reads as per-call time.
#: The computes whose sums `_per_call` fits, per fixed field, the first two cuts measured.
_FITTED = {
    "fixed_forward": ("forward",),
    "fixed_backward": ("backward", "backward_input", "backward_weight"),
}


def _per_call(
    reads: Sequence[_Read], fixed: dict[int | None, dict], defaults: Mapping[str, float]
) -> dict[int | None, dict]:
    """`fixed` (`_fixed` of `reads[0]`) with each stage's fixed fields read off how its
    computes' sum grows with their count over the cuts of `reads` (and over the stages the
    median); none the caller gives ([Note: a compute's per-call time]).

    Raises:
        ScheduleConfigError: every trace cuts the model as `reads[0]` does.
    """
    calls = {_calls(read, 0, "forward")[0] for read in reads}
    if len(calls) < 2:
        raise ScheduleConfigError(
            "the traces of other cuts cut the model as the trace does: a compute's per-call "
            "time needs runs at another v (e.g. interleaved-1f1b -v 2 beside 1f1b)"
        )
    out = {key: dict(row) for key, row in fixed.items()}
    fits: dict[str, list[float]] = {}
    for field, kinds in _FITTED.items():
        if field in defaults:
            continue
        for stage in reads[0].samples:
            for kind in kinds:
                points = [_calls(read, stage, kind) for read in reads]
                points = [(k, total) for k, total in points if k]
                if len({k for k, _ in points}) > 1:
                    break
            else:
                continue
            ks, totals = zip(*points)
            slope = statistics.linear_regression(ks, totals).slope
            floor = fixed.get(stage, {}).get(field, 0.0)
            ceiling = min(total / k for k, total in points)
            out.setdefault(stage, {})[field] = min(max(slope, floor), ceiling)
            fits.setdefault(field, []).append(out[stage][field])
    for field, values in fits.items():
        out.setdefault(None, {})[field] = float(statistics.median(values))
    return out


def _same_run(read: _Read, other: _Read, trace: object) -> None:
    """Raise unless `other` ran what `read` did but for the cut, as far as their records say
    (the device, and what the run trained beside its bytes: `"memory"` but the bytes)."""
    where = trace if isinstance(trace, (str, PathLike)) else "a trace of another cut"
    ours, theirs = read.metadata, other.metadata
    pairs = [("device", ours.get("device"), theirs.get("device"))]
    mine, yours = ours.get("memory"), theirs.get("memory")
    if isinstance(mine, Mapping) and isinstance(yours, Mapping):
        pairs += [(key, mine[key], yours[key]) for key in mine.keys() & yours.keys()]
    for key, value, got in sorted(pairs, key=lambda pair: pair[0]):
        if key not in ("activations", "inputs") and None not in (value, got) and value != got:
            raise ScheduleConfigError(
                f"{where} ran with {key} = {got!r} where the trace ran with {value!r}: a "
                "compute's per-call time needs runs of the same model, as trained, at other cuts"
            )


def _calls(read: _Read, stage: int, kind: str) -> tuple[float, float]:
    """How many `kind` computes `stage` runs per model replica in `read`'s run, and their
    medians' sum per replica; `(0, 0)` where it ran none."""
    medians = [
        float(statistics.median(values))
        for (each, _), values in read.samples.get(stage, {}).items()
        if each == kind
    ]
    return len(medians) / read.replicas, sum(medians) / read.replicas


def cost_fields() -> tuple[str, ...]:
    """The names of `CostModel`'s fields, in order: the durations and the overlap fraction (all
    but the overrides and the memory model).

    >>> cost_fields()[:2]
    ('forward', 'backward')
    """
    return tuple(f.name for f in attrs.fields(CostModel) if f.name not in _OVERRIDES)


_OVERRIDES = (
    "per_stage", "per_chunk", "memory", "per_microbatch", "per_segment", "other_segments",
)  # fmt: skip
