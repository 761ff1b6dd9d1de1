"""`tune`: rank schedules by simulated time over a grid of shapes, under a memory limit.

For each schedule and each (microbatch count m, chunk count v), `tune` builds, compiles and
simulates the program; v is drawn from the schedule's own `chunks` unless given. A shape the
schedule's constructor rejects (`ScheduleConfigError`, a v outside its `chunks` included) is
skipped; a program whose peak activations exceed `memory_limit` is set aside; the rest are ranked
by simulated time per microbatch (`makespan / m`). A schedule that fails otherwise (its own code
raises, or its program does not validate) is an error, not a silent drop.

[Note: tune's units] Costs are for one stage's share of the model with v = 1; with v chunks per
stage a chunk runs 1/v of that share, so its compute costs are divided by v (but for their
fixed part, [Note: a compute's fixed time]), and so are its copies' (an offload moves 1/v of the
bytes) and its warm-ups (its first computes of a step, [Note: a step's first computes]; comm and
update costs are not), except where the costs come per segment (`CostModel.per_segment`, [Note:
segment costs]). Activation memory
is counted the same way: a chunk's activations are 1/v of a stage's, so `peak_activations` is
the peak number of held chunk activations divided by v, in microbatches of a whole stage (1F1B's
stage 0 holds p); a `MemoryModel` in the costs is likewise a stage's sizes at v = 1 (a list
holds one per stage, and each segment takes the size of the stage that runs it, looped or V),
each chunk holding 1/v of them; bytes measured on real segments are each segment's own instead,
for programs of the cut they were measured on ([Note: a measured cut]). Ranking by `makespan /
m` compares throughput at a fixed microbatch size, and equally step time at a fixed global batch
when costs scale linearly with the microbatch size. A schedule with R model replicas (DualPipe,
[Note: replicas]) holds v / R chunks of one replica per stage, so each chunk runs R/v of the
share.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

from schedcc.compiler import compile, normalize_tied
from schedcc.costs import CHUNK_FIELDS, WARMUP_FIELDS, CostModel, fixed_share
from schedcc.errors import ScheduleConfigError, ScheduleError
from schedcc.ir import Recompute
from schedcc.memory_model import SIZE_FIELDS, MemoryModel
from schedcc.registry import build_schedule, get_schedule, registered_classes
from schedcc.schedule import Schedule, ScheduleCodeError
from schedcc.semantics import Layout
from schedcc.simulate import simulate
from schedcc.sizes import parse_size

__all__ = ["Candidate", "Skipped", "TuneResult", "priced", "tune"]

#: The largest chunk count a default grid tries (the CLI's own limit).
_MAX_CHUNKS = 64



@attrs.frozen
class Candidate:
    """One schedule at one shape, simulated.

    Attributes:
        schedule: the name it was asked for by (or the class's own name).
        num_microbatches, num_chunks: the shape (`m`, `v`; one batch).
        makespan: simulated time of the whole program.
        time_per_microbatch: `makespan / m`, the ranking key.
        bubble: the idle fraction, 0..1.
        peak_activations: the largest of `activations`.
        activations: peak activations per stage, in whole-stage microbatches.
        versions: peak weight versions held per stage.
        recompute: whether every forward is recomputed (`compile(..., recompute=True)`).
        peak_bytes: the largest of `bytes` (None without a memory model in the costs).
        bytes: peak bytes held per stage (`Timeline.peak_bytes`; empty without a memory model).
    """

    schedule: str
    num_microbatches: int
    num_chunks: int
    makespan: float
    time_per_microbatch: float
    bubble: float
    peak_activations: float
    activations: tuple[float, ...]
    versions: tuple[int, ...]
    recompute: bool = False
    peak_bytes: float | None = None
    bytes: tuple[float, ...] = ()


@attrs.frozen
class Skipped:
    """A shape a schedule's constructor rejects, or one measured bytes do not hold for ([Note:
    a measured cut]), and the reason."""

    schedule: str
    num_microbatches: int
    num_chunks: int
    reason: str


@attrs.frozen
class TuneResult:
    """What `tune` found: the ranking, what went over the memory limit, and what was skipped."""

    ranked: tuple[Candidate, ...]
    over_limit: tuple[Candidate, ...]
    skipped: tuple[Skipped, ...]
    #: whether the makespans are of the eager timeline (sends that never wait)
    eager: bool = False

    @property
    def best(self) -> Candidate | None:
        """The fastest candidate within the memory limit, or None if none fits."""
        return self.ranked[0] if self.ranked else None

    def to_dict(self) -> dict:
        """Plain lists and dicts (JSON-ready), the fields of each row as keys."""
        return {
            "ranked": [attrs.asdict(c) for c in self.ranked],
            "over_limit": [attrs.asdict(c) for c in self.over_limit],
            "skipped": [attrs.asdict(s) for s in self.skipped],
            "eager": self.eager,
        }


def tune(
    schedules: Iterable[str | type[Schedule]] | Mapping[str, type[Schedule]] | None = None,
    *,
    num_stages: int,
    num_microbatches: int | Iterable[int] = 8,
    num_chunks: int | Iterable[int] | None = None,
    costs: CostModel | None = None,
    memory_limit: float | str | None = None,
    data_parallel: int = 1,
    zero: int = 0,
    tied: Iterable[Iterable[int]] = (),
    grad_norm: bool = False,
    recompute: bool | Iterable[bool] = False,
    eager: bool = False,
) -> TuneResult:
    """Simulate each schedule at each (m, v) and rank those within `memory_limit` by time.

    Args:
        schedules: names (`"1f1b"`, `module:Class`, `file.py:Class`), classes, or a mapping
            from the name to show to the class; None: every registered schedule, once per class.
        num_stages: pipeline stages `p`.
        num_microbatches, num_chunks: the values of m and v to try (an int or several); v
            None: each schedule's first two chunk counts (`Schedule.chunk_counts`).
        costs: per-stage costs at v = 1 (default `CostModel()`); see [Note: tune's units].
        memory_limit: drop programs whose peak activations exceed this many whole-stage
            microbatches; when `costs.memory` is a `MemoryModel` (sizes per stage at v = 1),
            drop those whose peak bytes (`Timeline.peak_bytes`) exceed this many bytes
            instead (a number or a size such as "12GiB").
        data_parallel, zero: as in `schedcc.compile` (adds the gradient reductions).
        tied, grad_norm: as in `schedcc.compile`: the collectives of a tied group
            (`ReduceTied`, priced `costs.reduce`) and of the global gradient norm (`GradNorm`,
            `costs.norm`) in every program, as in the run they stand for. The schedules cut
            the model differently (v, DualPipe's replicas): name segments that hold at every
            cut, 0 the first and -1 the last, unless they all cut it alike.
        recompute: without (False), with (True) or both ways (`(False, True)`): full
            recomputation, `compile(..., recompute=True)`; each is its own candidate.
        eager: time each program as the distributed engine runs it, sends that never wait
            (`simulate(..., eager=True)`, [Note: eager simulation]); default: the rendezvous
            model the validator proves.

    Returns:
        A `TuneResult`: `ranked` fastest first (ties: less memory first), `over_limit`,
        `skipped`.

    Raises:
        UnknownScheduleError: a name that resolves to no schedule, or a registered schedule
            that does not load.
        ScheduleConfigError: a bad argument, or costs so large the makespan overflows.
        ScheduleError: a schedule fails at a shape it accepts (its code raises, or its program
            does not validate); the message names the schedule and the shape.

    >>> import schedcc
    >>> result = schedcc.tune(["gpipe", "1f1b"], num_stages=2, num_microbatches=4, num_chunks=1)
    >>> [(c.schedule, c.makespan, c.peak_activations) for c in result.ranked]
    [('1f1b', 15.0, 2.0), ('gpipe', 15.0, 4.0)]
    """
    costs = CostModel() if costs is None else costs
    if not isinstance(costs, CostModel):
        raise ScheduleConfigError(f"tune: costs must be a CostModel, got {costs!r}")
    if not isinstance(eager, bool):
        raise ScheduleConfigError(f"tune: eager must be True or False, got {eager!r}")
    in_bytes = costs.memory is not None
    if in_bytes and memory_limit is not None:
        memory_limit = parse_size(memory_limit)
    if not isinstance(grad_norm, bool):
        raise ScheduleConfigError(f"tune: grad_norm must be True or False, got {grad_norm!r}")
    grid = _Grid.of(num_stages, num_microbatches, num_chunks, memory_limit)
    classes = _resolve(schedules)

    def chunk_counts(cls: type[Schedule]) -> tuple[int, ...]:
        return grid.chunks or cls.chunk_counts(_MAX_CHUNKS, first=2)

    cuts = {num_stages * v for c in classes.values() for v in chunk_counts(c)}
    options = {"data_parallel": data_parallel, "zero": zero, "grad_norm": grad_norm}
    options["tied"] = tied_at_cuts(tied, cuts, "tune")  # one cut, where an index is above 0
    tuner = _Tuner(num_stages, costs, options, eager)
    results = [
        tuner.run(name, cls, m, v, r)
        for name, cls in classes.items()
        for m in grid.microbatches
        for v in chunk_counts(cls)
        for r in _recompute_values(recompute)
    ]
    candidates = [r for r in results if isinstance(r, Candidate)]

    def held(c: Candidate) -> float:
        return c.peak_bytes if in_bytes else c.peak_activations  # type: ignore[return-value]

    fits = [memory_limit is None or held(c) <= memory_limit for c in candidates]
    ranked = sorted(
        (c for c, ok in zip(candidates, fits) if ok),
        key=lambda c: (c.time_per_microbatch, held(c), c.schedule, c.recompute),
    )
    skipped = {(r.schedule, r.num_microbatches, r.num_chunks): r for r in results}
    return TuneResult(
        ranked=tuple(ranked),
        over_limit=tuple(c for c, ok in zip(candidates, fits) if not ok),
        skipped=tuple(r for r in skipped.values() if isinstance(r, Skipped)),
        eager=eager,
    )


def names_one_cut(tied: Iterable[Iterable[int]]) -> bool:
    """Whether `tied` names a segment above 0: one that is the same segment at one cut only."""
    return any(k > 0 for group in tied for k in group)


def tied_at_cuts(tied, cuts: Iterable[int], caller: str) -> tuple[tuple[int, ...], ...]:
    """`tied` as a tuple of groups, checked at every cut (segments of one model replica) the
    candidates make: `ScheduleConfigError` on a malformed group or one out of range, or, with
    several cuts, an index above 0 (only 0 and negative indices mean the same segment at each).
    """
    cuts = sorted(set(cuts))
    for cut in cuts:
        normalize_tied(tied, cut)
    groups = tuple(tuple(group) for group in tied)
    if len(cuts) > 1 and names_one_cut(groups):
        raise ScheduleConfigError(
            f"{caller}: tied={list(groups)!r} names segments of one cut, but the orders cut the "
            f"model in {' or '.join(map(str, cuts))} segments: name the first 0 and count the "
            "others from the last (-1 the last), or try one num_chunks"
        )
    return groups


def _recompute_values(recompute: bool | Iterable[bool]) -> tuple[bool, ...]:
    values = (recompute,) if isinstance(recompute, bool) else tuple(recompute)
    if not values or any(not isinstance(r, bool) for r in values):
        raise ScheduleConfigError(
            f"tune: recompute must be True, False or both, (False, True); got {recompute!r}"
        )
    return tuple(sorted(set(values)))


@attrs.frozen
class _Grid:
    microbatches: tuple[int, ...]
    chunks: tuple[int, ...] | None  # None: each schedule's own

    @classmethod
    def of(cls, num_stages, num_microbatches, num_chunks, memory_limit) -> _Grid:
        """The checked arguments of `tune` (raises `ScheduleConfigError` naming a bad one)."""
        _positive_ints("num_stages", [num_stages])
        ok = memory_limit is None or (
            isinstance(memory_limit, (int, float))
            and not isinstance(memory_limit, bool)
            and 0 < memory_limit < math.inf
        )
        if not ok:
            raise ScheduleConfigError(
                f"tune: memory_limit must be a positive number or None, got {memory_limit!r}"
            )
        return cls(
            _positive_ints("num_microbatches", num_microbatches),
            None if num_chunks is None else _positive_ints("num_chunks", num_chunks),
        )


def _positive_ints(arg: str, values: int | Iterable[int]) -> tuple[int, ...]:
    """`values` (one int or several) as a sorted tuple without repeats, each checked >= 1."""
    items = [values] if isinstance(values, int) else list(values)
    for value in items:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleConfigError(f"tune: {arg} must be positive integers, got {value!r}")
    if not items:
        raise ScheduleConfigError(f"tune: {arg} is empty; give at least one value")
    return tuple(sorted(set(items)))


def _resolve(
    schedules: Iterable[str | type[Schedule]] | Mapping[str, type[Schedule]] | None,
) -> dict[str, type[Schedule]]:
    """The schedules to try, by the name to show."""
    if schedules is None:
        return registered_classes()
    if isinstance(schedules, Mapping):
        return dict(schedules)
    if isinstance(schedules, (str, type)):
        schedules = [schedules]
    found: dict[str, type[Schedule]] = {}
    for item in schedules:
        if isinstance(item, str):
            found[item] = get_schedule(item)
        elif isinstance(item, type) and issubclass(item, Schedule):
            found[item.name or item.__name__] = item
        else:
            raise ScheduleConfigError(
                f"tune: a schedule is a name or a Schedule subclass, got {item!r}"
            )
    return found


@attrs.frozen
class _Tuner:
    """What stays fixed over the grid; `run` tries one schedule at one (m, v)."""

    num_stages: int
    costs: CostModel
    options: dict  # compile's: data_parallel, zero, tied, grad_norm
    eager: bool = False

    def run(
        self, name: str, cls: type[Schedule], m: int, v: int, recompute: bool = False
    ) -> Candidate | Skipped:
        """The simulated candidate, or why the shape is skipped; a schedule's failure raises."""
        factors = len(self.costs.per_microbatch)
        if factors and factors != m:
            return Skipped(name, m, v, f"costs.per_microbatch gives {factors} microbatches")
        try:
            schedule = build_schedule(cls, self.num_stages, m, num_chunks=v)
        except ScheduleConfigError as exc:
            return Skipped(name, m, v, str(exc))
        share = v // type(schedule).num_replicas  # the chunks of one model replica per stage
        mismatch = other_cut(self.costs.memory, self.num_stages, share)
        if mismatch is not None:
            return Skipped(name, m, v, mismatch)
        tied = self.options["tied"]
        if share != v and names_one_cut(tied):
            cut = v * self.num_stages
            return Skipped(name, m, v, f"tied={list(tied)!r} names segments of a cut in {cut}")
        if self.options["zero"] == 3 and schedule.weight_delay:
            return Skipped(name, m, v, "zero=3 keeps no whole stashed weights (weight delay)")
        if recompute and schedule.num_parts > 1:
            return Skipped(name, m, v, "sequence parts hand their carry on: no recomputation")
        try:
            program = compile(schedule, recompute=recompute, **self.options)
        except ScheduleCodeError as exc:
            raise type(exc)(f"{name}: {exc}") from exc
        except ScheduleConfigError:
            raise
        except ScheduleError as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            raise type(exc)(
                f"{name} at p={self.num_stages}, m={m}, v={v}: {type(exc).__name__}: {first} "
                f"(schedcc verify --schedule {name} -p {self.num_stages} -m {m} -v {v} "
                "explains)",
                stage=exc.stage,
                position=exc.position,
            ) from exc
        return _measure(name, program, priced(self.costs, schedule), share, eager=self.eager)


def priced(costs: CostModel, schedule: Schedule) -> CostModel:
    """`costs`, in a stage's units at v = 1 ([Note: tune's units]), priced for `schedule`'s
    chunks: each its share of its stage (a stage's chunks of one model replica), per-segment
    costs and sizes where its segments lie; what `simulate` takes for a program of it."""
    share = schedule.num_chunks // type(schedule).num_replicas
    return _per_chunk(costs, share, Layout.of(schedule).place)


def _placed(memory: MemoryModel, stage_of: Sequence[int]) -> MemoryModel:
    """`memory` with every list of one size per stage (at v = 1) turned into one per segment,
    each segment taking its stage's size ([Note: tune's units]); a single size, or a list of
    another length, stays as it is."""
    num_stages = max(stage_of) + 1

    def placed(value):
        if isinstance(value, tuple) and len(value) == num_stages != len(stage_of):
            return tuple(value[s] for s in stage_of)
        return value

    return attrs.evolve(
        memory,
        **{field: placed(getattr(memory, field)) for field in SIZE_FIELDS},
    )


def _measure(
    name: str, program, costs: CostModel, share: int, *, eager: bool = False
) -> Candidate:
    """Simulate `program` into a `Candidate` (see [Note: tune's units]), eagerly or not;
    `share` is how many chunks a stage's share of the model is cut into."""
    schedule = program.schedule
    m, v = schedule.num_microbatches, schedule.num_chunks
    timeline = simulate(program, costs, eager=eager)
    if not math.isfinite(timeline.makespan):
        raise ScheduleConfigError(
            f"{name} at p={schedule.num_stages}, m={m}, v={v}: the simulated makespan "
            f"overflows ({timeline.makespan}); give the costs in a larger unit (smaller numbers)"
        )
    activations = tuple(round(n / share, 3) for n in timeline.peak_activations)
    held = timeline.peak_bytes if costs.memory is not None else ()
    return Candidate(
        schedule=name,
        num_microbatches=m,
        num_chunks=v,
        makespan=timeline.makespan,
        time_per_microbatch=timeline.makespan / m,
        bubble=round(timeline.bubble_fraction, 4),
        peak_activations=max(activations),
        activations=activations,
        versions=tuple(timeline.peak_versions),
        recompute=any(type(op) is Recompute for ops in program.stages for op in ops),
        peak_bytes=max(held) if held else None,
        bytes=tuple(held),
    )


def _per_chunk(
    costs: CostModel, num_chunks: int, place: Sequence[tuple[int, int]] | None = None
) -> CostModel:
    """`costs` with compute and copy costs and memory sizes divided by `num_chunks` (see
    [Note: tune's units]; a compute's fixed part whole, [Note: a compute's fixed time]); given
    `place` (the `(stage, chunk)` of each segment of a program), a `MemoryModel`'s per-stage
    sizes (one per stage) become the sizes of the segments each stage runs, and per-segment
    costs are placed on them (`CostModel.placed`, [Note: segment costs]). Measured sizes
    (`MemoryModel.cut`) and per-segment costs are each segment's own and are not divided
    ([Note: a measured cut])."""
    memory = costs.memory
    if memory is not None and memory.cut is None:
        if place is not None:
            memory = _placed(memory, [stage for stage, _ in place])
        if num_chunks != 1:
            memory = memory.scaled(1 / num_chunks)
    if num_chunks == 1:
        scaled = costs if memory is costs.memory else attrs.evolve(costs, memory=memory)
    else:
        divided = {  # each its fixed part whole: [Note: a compute's fixed time]
            name: fixed_share(costs, name, getattr(costs, name), num_chunks)
            for name in CHUNK_FIELDS
            if getattr(costs, name) is not None  # an unset recompute cost follows the forward's
        }
        divided.update(  # each chunk's first computes: [Note: a step's first computes]
            {name: getattr(costs, name) / num_chunks for name in WARMUP_FIELDS}
        )
        scaled = attrs.evolve(
            costs,
            **divided,
            memory=memory,
            per_stage={s: _per_chunk(m, num_chunks) for s, m in costs.per_stage.items()},
            per_chunk={c: _per_chunk(m, num_chunks) for c, m in costs.per_chunk.items()},
        )
    if place is None or not costs.per_segment:
        return scaled
    num_stages = max(stage for stage, _ in place) + 1
    return scaled.placed(place, num_stages * num_chunks)


def other_cut(memory: MemoryModel | None, num_stages: int, share: int) -> str | None:
    """Why measured sizes (`memory.cut`) do not hold for a program of `num_stages` stages with
    `share` chunks of one model replica each, or None when they do ([Note: a measured cut])."""
    if memory is None or memory.cut is None or memory.cut == num_stages * share:
        return None
    return (
        f"its model is cut in {num_stages * share} segments (a replica's), the bytes were "
        f"measured on a cut in {memory.cut}"
    )
