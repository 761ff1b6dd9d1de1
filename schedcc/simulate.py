"""The simulator: how long a program takes, where its bubbles are and what it holds in memory.

`simulate(program, costs)` times the very rendezvous model the validator proves deadlock-free (see
[Note: the rendezvous model] in `schedcc.semantics.units`): each stage runs its program in order, a
compute or update takes its cost, a comm group is posted when its stage reaches it and done once
every partner group is posted, plus the comm cost. One linear pass; the result is a `Timeline`.
A program is validated before it is timed (once: the proof is kept on the program), so a
program the validator refuses is refused here too, with the validator's error.

    >>> import schedcc
    >>> program = schedcc.compile(schedcc.get_schedule("1f1b")(4, 8))
    >>> timeline = schedcc.simulate(program)
    >>> timeline.makespan, round(timeline.bubble_fraction, 4)
    (33.0, 0.2727)

`simulate(program, costs, eager=True)` times the same program as the distributed engine runs it
over gloo: sends never wait (see [Note: eager simulation] in `schedcc.simulate_eager`).
"""

from __future__ import annotations

from collections import Counter
from functools import cached_property
from os import PathLike
from pathlib import Path
from typing import NamedTuple

import attrs

from schedcc._gc import paused_gc
from schedcc.costs import ALL_KINDS, CostModel, kind_cost, takes, warmups
from schedcc.errors import DeadlockError, ScheduleConfigError
from schedcc.ir import COMPUTE, Compute, Instruction
from schedcc.memory_model import MemoryModel
from schedcc.program import Program
from schedcc.semantics import (
    CopyLanes,
    Layout,
    StageBytes,
    Tensors,
    Units,
    Walk,
    critical_units,
    host_bytes,
    peak_activations,
    peak_live_versions,
    stage_peak,
    versions_of,
    walk,
)
from schedcc.semantics.stage_bytes import chunk_sizes, peak_activation_bytes
from schedcc.simulate_eager import eager_spans
from schedcc.validate import ensure_valid

__all__ = ["CostModel", "Event", "Timeline", "simulate"]


class Event(NamedTuple):
    """One instruction's time on its stage; a comm op spans its group's posted..done."""

    stage: int
    instruction: Instruction
    start: float
    end: float


@attrs.frozen(slots=True)
class _Run:
    """What `simulate` keeps to answer questions lazily: the units, the pairing and the walk."""

    units: Units
    partner: list
    walk: Walk
    tables: list[dict | None]  # per stage: cost per instruction class, None if per chunk


@attrs.frozen(slots=False, eq=False)
class Timeline:
    """A simulated (or measured) run: per-instruction events and what follows from them.

    Build one with `simulate`, or from a measured run's events: `Timeline(program, events)`.

    Attributes:
        program: the program it times.
        events: `Event(stage, instruction, start, end)` per instruction, stage by stage, each
            stage in program order (built on first use for a simulated timeline).
        costs: the cost model used (None for a measured timeline).
    """

    program: Program
    _events: tuple[Event, ...] | None = attrs.field(default=None, alias="events", repr=False)
    costs: CostModel | None = None
    _run: _Run | None = attrs.field(default=None, alias="run", repr=False)

    @property
    def num_stages(self) -> int:
        return self.program.num_stages

    @cached_property
    def events(self) -> tuple[Event, ...]:  # type: ignore[no-redef]
        """`Event(stage, instruction, start, end)` per instruction (see the class docstring)."""
        if self._events is not None:
            return tuple(Event(*event) for event in self._events)
        if self._run is None:
            return ()
        units, walked = self._run.units, self._run.walk
        events = []
        with paused_gc():
            for s, ops in enumerate(self.program.stages):
                starts, ends = walked.start[s], walked.end[s]
                for op, j in zip(ops, units.unit_at[s]):
                    events.append(Event(s, op, starts[j], ends[j]))
            return tuple(events)

    @cached_property
    def makespan(self) -> float:
        """When the last instruction ends."""
        if self._run is not None and self._events is None:
            return max((row[-1] for row in self._run.walk.end if row), default=0.0)
        return max((e.end for e in self.events), default=0.0)

    @cached_property
    def busy(self) -> tuple[float, ...]:
        """Per stage, the time spent in computes (F, B, I, W)."""
        busy = [0.0] * self.num_stages
        if self._run is not None and self._events is None:
            for s, ops in enumerate(self.program.stages):
                busy[s] = _stage_busy(ops, self._run, s)
            return tuple(busy)
        for e in self.events:
            if isinstance(e.instruction, Compute):
                busy[e.stage] += e.end - e.start
        return tuple(busy)

    @property
    def idle(self) -> tuple[float, ...]:
        """Per stage, the makespan minus its compute time (bubbles, comm and updates)."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """`1 - busy compute / (p * makespan)`."""
        if not self.makespan:
            return 0.0
        return 1.0 - sum(self.busy) / (self.num_stages * self.makespan)

    @cached_property
    def peak_activations(self) -> tuple[int, ...]:
        """Per stage, the most microbatch activations held at once: each from its F to its last
        backward piece, B or W (`schedcc.semantics.activations`, the validator's count); none in a
        forward-only program, whose forwards keep nothing for a backward."""
        if self.program.forward_only:
            return (0,) * self.num_stages
        return tuple(peak_activations(ops) for ops in self.program.stages)

    @cached_property
    def peak_activation_bytes(self) -> tuple[float, ...]:
        """Per stage, the most activation bytes held at once: `peak_activations` weighted by
        each segment's `costs.memory.activations`, plus the inputs recomputed forwards keep
        until their `Recompute` (what the engines' `peak_activation_bytes` measure; [Note:
        bytes per stage] in `schedcc.semantics.stage_bytes`).

        Raises:
            ScheduleConfigError: the cost model has no `memory`.
        """
        memory = self._memory()
        return tuple(peak_activation_bytes(self.program, memory, s) for s in range(self.num_stages))

    @cached_property
    def peak_host_bytes(self) -> tuple[float, ...]:
        """Per stage, the most activation bytes held on the host at once: those of each
        microbatch from its `Offload` to its `Reload` ([Note: offloading] in
        `schedcc.rules.offload`); `peak_activation_bytes` counts the device only.

        Raises:
            ScheduleConfigError: the cost model has no `memory`.
        """
        memory = self._memory()
        return tuple(
            max(host_bytes(ops, chunk_sizes(self.program, memory, s, "activations")), default=0.0)
            for s, ops in enumerate(self.program.stages)
        )

    @cached_property
    def stage_bytes(self) -> tuple[StageBytes, ...]:
        """Per stage, the bytes it holds by kind (`schedcc.semantics.StageBytes`): the most
        activations (as `peak_activation_bytes`), parameters (whole, or ZeRO shards: under
        ZeRO-3 whole only from a chunk's `Unshard` to its `Reshard`), 2BW's stashed weight
        copies (one per version its computes still use), gradients (shards after a ZeRO
        reduce-scatter) and optimizer state held at once, and the most of all of them at once
        (`total`).

        Raises:
            ScheduleConfigError: the cost model has no `memory`.
        """
        memory = self._memory()
        return tuple(stage_peak(self.program, memory, s) for s in range(self.num_stages))

    @property
    def peak_bytes(self) -> tuple[float, ...]:
        """Per stage, the most bytes held at once (`stage_bytes`' `total`)."""
        return tuple(b.total for b in self.stage_bytes)

    def _memory(self) -> MemoryModel:
        memory = self.costs.memory if self.costs is not None else None
        if memory is None:
            raise ScheduleConfigError(
                "bytes need a memory model: simulate(program, CostModel(memory=MemoryModel("
                "activations=..., parameters=..., optimizer=...))), e.g. measured with "
                "schedcc.backends.runtime.memory.measure_memory"
            )
        schedule = self.program.schedule
        memory.check(schedule.num_segments, type(schedule).num_replicas)
        return memory

    @cached_property
    def peak_versions(self) -> tuple[int, ...]:
        """Per stage, the most weight versions held at once
        (`schedcc.semantics.versions.peak_live_versions`)."""
        program = self.program
        versions = program.versions
        if versions is None:
            m, delay = program.schedule.num_microbatches, program.schedule.weight_delay
            versions = tuple(versions_of(ops, m, delay) for ops in program.stages)
        return tuple(peak_live_versions(ops, row) for ops, row in zip(program.stages, versions))

    @cached_property
    def critical_path(self) -> tuple[Event, ...]:
        """A chain of events, in time order, from time 0 to the makespan with no slack.

        Each event's start is set by the one before it: the previous unit on its stage, or the
        partner group its comm group waited for. Empty for a measured or an eager timeline.
        """
        if self._run is None:
            return ()
        stages, run = self.program.stages, self._run
        return tuple(
            Event(s, stages[s][pos], run.walk.start[s][j], run.walk.end[s][j])
            for s, j in critical_units(run.units, run.partner, run.walk)
            for pos in range(*run.units.bounds[s][j])
        )

    def summary(self) -> str:
        """One line: makespan, bubble and peak activations per stage."""
        peaks = " ".join(str(n) for n in self.peak_activations)
        return (
            f"makespan {self.makespan:g}, bubble {self.bubble_fraction:.1%}, "
            f"peak activations per stage [{peaks}], peak weight versions {max(self.peak_versions)}"
        )

    # -- exporters: each drawn by its module in schedcc.draw --------------------------------------

    def to_ascii(self, *, width: int | None = None, color: bool | None = None) -> str:
        """A row per stage, one column per time unit (scaled to `width`); see `schedcc.draw`."""
        from schedcc.draw.ascii import render

        return render(self, width=width, color=color)

    def save(self, path: str | PathLike, *, title: str | None = None) -> Path:
        """The paper figure as PNG or SVG (by suffix), drawn with matplotlib."""
        from schedcc.draw.figure import save

        return save(self, path, title=title)

    def to_chrome_trace(self, path: str | PathLike) -> Path:
        """Trace Event Format JSON (opens in Perfetto / chrome://tracing)."""
        from schedcc.draw.chrome import save

        return save(self, path)


def simulate(program: Program, costs: CostModel | None = None, *, eager: bool = False) -> Timeline:
    """Time `program` under `costs` on the rendezvous model the validator proves; linear.

    Args:
        program: a compiled program (`schedcc.compile`).
        costs: the cost model; `CostModel()` (F = 1, B = 2, I = W = 1, free comm) by default.
            Its `per_segment` costs, if any, are placed on the program's segments first
            (`CostModel.placed`).
        eager: time it with sends that never wait, as the distributed engine runs over gloo
            (see [Note: eager simulation]); a comm op then spans its message's flight, and the
            timeline has no critical path.

    Raises:
        ScheduleError: the program cannot run to the end (the validator's error says why).

    >>> import schedcc
    >>> program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 4))
    >>> schedcc.simulate(program).makespan
    15.0
    """
    if not isinstance(program, Program):
        raise ScheduleConfigError(f"simulate() needs a compiled Program, got {program!r}")
    costs = CostModel() if costs is None else costs
    if not isinstance(costs, CostModel):
        raise ScheduleConfigError(f"costs must be a CostModel, got {costs!r}")
    ensure_valid(program)  # the validator's error for a program it refuses
    costs.check_microbatches(program.schedule.num_microbatches)
    if costs.per_segment:  # [Note: segment costs]
        layout = Layout.of(program.schedule)
        costs = costs.placed(layout.place, layout.replica_length)
    stages = program.stages
    with paused_gc():
        tables = _tables(costs, len(stages))
        if eager:
            events = _eager_events(program, costs, tables, program.tensors)
            return Timeline(program, events=events, costs=costs)
        model = program.rendezvous_model
        units, partner, problems = model.units, model.partner, model.problems
        if costs == _DEFAULT:  # the validator's walk: [Note: the reference walk]
            result = program.reference_walk
        else:
            durations = _durations(costs, tables, stages, units, _extra(costs, program))
            lanes = CopyLanes.of(stages, units)  # [Note: offloading]
            result = walk(units, partner, durations, links=model.links, lanes=lanes)
    if result.stuck or problems:  # cannot happen for a validated program
        raise DeadlockError("the program cannot run to the end; it does not validate")
    return Timeline(program, costs=costs, run=_Run(units, partner, result, tables))


#: The default cost model, whose walk is the reference walk (`UNIT_COSTS` are its durations).
_DEFAULT = CostModel()


def _extra(costs: CostModel, program: Program) -> dict[tuple[int, int], float]:
    """`{(stage, position): extra}`: what a compute takes beyond its cost, a chunk's first
    computes warming up and the messages it takes ([Note: a step's first computes], [Note: a
    receive's take] in `schedcc.costs`)."""
    extra = warmups(costs, program.stages)
    for key, value in takes(costs, program.stages, program.tensors).items():
        extra[key] = extra.get(key, 0.0) + value
    return extra


def _tables(costs: CostModel, num_stages: int) -> list[dict | None]:
    """Per stage, the cost of each instruction class, or None where a per-chunk override, a
    per-microbatch factor, a warm-up or a receive's take can apply (then each op resolves its
    own cost)."""
    tables: list[dict | None] = []
    for s in range(num_stages):
        model = costs.per_stage.get(s, costs)
        extra = (
            model.warmup_forward or model.warmup_backward or model.receive or model.warmup_receive
        )
        if costs.per_microbatch or model.per_chunk or (model is costs and costs.per_chunk) or extra:
            tables.append(None)
        else:
            tables.append({cls: kind_cost(model, cls) for cls in ALL_KINDS})
    return tables


def _durations(costs: CostModel, tables, stages, units: Units, extra) -> list[list[float]]:
    """`durations[s][j]`: the cost of unit j on stage s (one dict lookup per unit, usually),
    with `extra[s, position]` where a stage's first compute of a kind warms up."""
    out = []
    for s, ops in enumerate(stages):
        table, bounds = tables[s], units.bounds[s]
        if table is None:
            row = [costs.cost(s, ops[lo]) + extra.get((s, lo), 0.0) for lo, _ in bounds]
        else:
            row = [table[type(ops[lo])] for lo, _ in bounds]
        out.append(row)
    return out


def _eager_events(program: Program, costs: CostModel, tables, tensors: Tensors) -> list[Event]:
    """The eager timeline's events, stage by stage in program order (`schedcc.simulate_eager`)."""

    def cost(s: int, op: Instruction) -> float:
        table = tables[s]
        return table[type(op)] if table is not None else costs.cost(s, op)

    meets = program.rendezvous_model.meets or None  # ReduceTied and GradNorm collectives
    extra = _extra(costs, program)
    spans = eager_spans(program.stages, tensors, cost, meets=meets, extra=extra)
    if spans is None:  # cannot happen for a validated program
        raise DeadlockError("the program cannot run to the end; it does not validate")
    return [
        Event(s, op, *span)
        for s, ops in enumerate(program.stages)
        for op, span in zip(ops, spans[s])
    ]


def _stage_busy(ops, run: _Run, s: int) -> float:
    """Compute time on stage s: counted by class when costs are per class, else summed."""
    table = run.tables[s]
    if table is not None:
        counts = Counter(map(type, ops))
        return sum(counts[cls] * table[cls] for cls in COMPUTE)
    starts, ends = run.walk.start[s], run.walk.end[s]
    return sum(
        ends[j] - starts[j]
        for j, (lo, _) in enumerate(run.units.bounds[s])
        if isinstance(ops[lo], Compute)
    )
