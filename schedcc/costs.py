"""`CostModel`: what each instruction costs in a simulation, by kind, stage and chunk.

Given by hand (`CostModel(forward=1, backward=2, comm=0.1, per_stage={...})`) or measured
(`CostModel.from_trace("run.json")`, the medians of a real run's Chrome trace).

    >>> from schedcc.costs import CostModel
    >>> CostModel(forward=1.5, per_stage={3: CostModel(forward=3.0)}).at(3).forward
    3.0
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from math import inf
from os import PathLike
from types import MappingProxyType

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
    "CostModel",
    "cost_fields",
    "kind_cost",
    "measured_backward",
    "overlapped_pair",
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


@attrs.frozen(slots=True, eq=True, hash=False)
class CostModel:
    """Durations of each instruction kind, in any consistent unit (default: a forward is 1).

    Args:
        forward, backward, backward_input, backward_weight: compute costs (F, B, I, W).
        comm: the cost of one comm group (a batched exchange), on top of waiting for the peer.
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
        memory: bytes per segment (`schedcc.MemoryModel`), for `Timeline.peak_bytes`
            and `Timeline.peak_activation_bytes`; read from the top-level model only.
        per_stage: `{stage: CostModel}`; that stage reads its costs from the given model.
        per_chunk: `{chunk: CostModel}`; computes on that chunk read from the given model.
        per_microbatch: one factor per microbatch of a batch (`m` of them, e.g. its samples
            or tokens relative to the mean): a compute of microbatch `i` costs what the model
            says times `per_microbatch[i % m]` (microbatches of unequal size, see
            `schedcc.microbatches`); comm and updates are not scaled. An overlapped pair's
            forward takes its factor and the backward's rest (`overlapped_pair`) takes the
            backward's. Read from the top-level model only; the simulators refuse another
            count than the program's `m`. Empty (the default): every microbatch alike.

    Resolution, most specific first: `per_stage[s].per_chunk[c]`, `per_stage[s]`,
    `per_chunk[c]`, then this model's own fields. A comm group reads the model of its first op.

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
    per_stage: Mapping[int, CostModel] = attrs.field(factory=dict, converter=_overrides)
    per_chunk: Mapping[int, CostModel] = attrs.field(factory=dict, converter=_overrides)
    per_microbatch: tuple[float, ...] = attrs.field(default=(), converter=_factors)

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
        trace: str | PathLike | Iterable[Mapping],
        *,
        unit_us: float = 1000.0,
        num_stages: int | None = None,
        **defaults: float,
    ) -> CostModel:
        """Costs measured in a run: the median duration of each instruction kind, per stage.

        Args:
            trace: a Chrome trace file (a JSON list, or an object with "traceEvents"), or its
                events. Complete events ("ph": "X") whose name parses as an instruction
                (`F3.1`, `B0`, `Reduce`, ...) count; the stage is their `pid` when the events
                span several pids (a process per stage), else their `tid`; `dur` is the
                duration in microseconds. A comm op's duration includes any wait for its peer.
            unit_us: microseconds per cost unit: 1000 reads back what `to_chrome_trace` wrote
                (1 ms per unit); 1e6 gives seconds.
            num_stages: the stages the trace must measure, 0 to `num_stages - 1` (a stage's
                costs depend on how the model was cut: a trace of another depth is refused);
                None: any.
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
        events, metadata = read_chrome_trace(trace)
        if metadata.get("device") == "cpu":
            defaults = {"overlap": 1.0, **defaults}
        replicas = _replicas(metadata.get("cut"))
        found = [(event, kind) for event in events if (kind := _kind_of(event)) is not None]
        by_pid = len({event.get("pid", 0) for event, _ in found}) > 1
        samples: dict[int, dict[tuple[str, int], list[float]]] = {}
        for event, (kind, chunk) in found:
            try:
                track = int(event.get("pid", 0) if by_pid else event.get("tid", 0))
                stage = track if by_pid else track_stage(track)
                duration = float(event["dur"]) / unit_us
            except (TypeError, ValueError):
                raise ScheduleConfigError(
                    f"trace event {event.get('name')!r}: its dur, pid and tid must be numbers"
                ) from None
            samples.setdefault(stage, {}).setdefault((kind, chunk), []).append(duration)
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
        per_stage = {
            stage: cls(**{**defaults, **_both_ways(_medians(kinds, replicas), defaults)})
            for stage, kinds in samples.items()
        }
        overall: dict[tuple[str, int], list[float]] = {}
        for kinds in samples.values():
            for key, values in kinds.items():
                overall.setdefault(key, []).extend(values)
        measured = _medians(overall, replicas)
        return cls(**{**defaults, **_both_ways(measured, defaults)}, per_stage=per_stage)


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
    whole = any(k == "backward" for k, _ in kinds)
    split = any(k in ("backward_input", "backward_weight") for k, _ in kinds)
    return (False,) if whole and not split else (False, True)


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
def _both_ways(measured: dict[str, float], defaults: Mapping[str, float]) -> dict[str, float]:
    out = dict(measured)
    split = ("backward_input", "backward_weight")
    if "backward" in out and not any(k in out or k in defaults for k in split):
        out.update(dict.fromkeys(split, out["backward"] / 2))
    elif all(k in out for k in split) and "backward" not in out and "backward" not in defaults:
        out["backward"] = out["backward_input"] + out["backward_weight"]
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
    # a measured overlapped backward ran as a backward (the CPU backends run the pair in order)
    kind = "backward" if isinstance(op, OverlappedBackward) else _FIELD[type(op)]
    return kind, op.chunk if kind in CHUNK_FIELDS else 0


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


def _medians(kinds: Mapping[tuple[str, int], list[float]], replicas: int) -> dict[str, float]:
    """Each field's cost in a stage's units ([Note: a trace's cut]): per chunk a median, the
    chunks of a chunk's kind summed over the replicas."""
    out: dict[str, float] = {}
    for (kind, _), values in sorted(kinds.items()):
        share = replicas if kind in CHUNK_FIELDS else 1
        out[kind] = out.get(kind, 0.0) + float(statistics.median(values)) / share
    return out


def cost_fields() -> tuple[str, ...]:
    """The names of `CostModel`'s fields, in order: the durations and the overlap fraction (all
    but the overrides and the memory model).

    >>> cost_fields()[:2]
    ('forward', 'backward')
    """
    return tuple(f.name for f in attrs.fields(CostModel) if f.name not in _OVERRIDES)


_OVERRIDES = ("per_stage", "per_chunk", "memory", "per_microbatch")
