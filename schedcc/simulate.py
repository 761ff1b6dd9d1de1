"""The simulator: how long a program takes, where its bubbles are and what it holds in memory.

`simulate(program, costs)` times the very step model the validator proves deadlock-free (see
[Note: the step model] in `schedcc.analysis`): each stage runs its program in order, a compute or
update takes its cost, a comm group is posted when its stage reaches it and done once every
partner group is posted, plus the comm cost. One linear pass; the result is a `Timeline`.

    >>> import schedcc
    >>> program = schedcc.compile(schedcc.get_schedule("1f1b")(4, 8))
    >>> timeline = schedcc.simulate(program)
    >>> timeline.makespan, round(timeline.bubble_fraction, 4)
    (33.0, 0.2727)
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from functools import cached_property
from math import inf
from os import PathLike
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

import attrs

from schedcc.analysis import Layout, Steps, Walk, match_comm, paused_gc, walk
from schedcc.errors import DeadlockError, ScheduleConfigError
from schedcc.ir import COMM, COMPUTE, UPDATE, Instruction, parse
from schedcc.passes.assign_versions import assign_versions
from schedcc.program import Program

__all__ = ["CostModel", "Event", "Timeline", "simulate"]

#: The cost field each instruction code reads.
_FIELD = {
    "F": "forward",
    "B": "backward",
    "I": "backward_input",
    "W": "backward_weight",
    "Reduce": "reduce",
    "Step": "step",
    "Gather": "gather",
}
_COMPUTE_CODES = frozenset("FBIW")
_ALL_KINDS = (*COMPUTE, *COMM, *UPDATE)


def _kind_cost(model: CostModel, cls: type[Instruction]) -> float:
    """The field of `model` that instructions of class `cls` cost."""
    return model.comm if cls.group == "comm" else getattr(model, _FIELD[cls.code])


def _non_negative(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < inf:
        raise ScheduleConfigError(
            f"CostModel.{attribute.name} must be a finite non-negative number, got {value!r}"
        )


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
        reduce: a `ReduceGrads` (all-reduce, or reduce-scatter under ZeRO).
        step: an `OptimizerStep`.
        gather: a `GatherParams` (ZeRO-1's all-gather).
        per_stage: `{stage: CostModel}`; that stage reads its costs from the given model.
        per_chunk: `{chunk: CostModel}`; computes on that chunk read from the given model.

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
    gather: float = attrs.field(default=0.0, validator=_non_negative)
    per_stage: Mapping[int, CostModel] = attrs.field(factory=dict, converter=_overrides)
    per_chunk: Mapping[int, CostModel] = attrs.field(factory=dict, converter=_overrides)

    def at(self, stage: int, chunk: int = 0) -> CostModel:
        """The model that applies to `chunk` on `stage` (see the resolution order above)."""
        model = self.per_stage.get(stage)
        if model is not None:
            return model.per_chunk.get(chunk, model)
        return self.per_chunk.get(chunk, self)

    def cost(self, stage: int, op: Instruction) -> float:
        """The duration of `op` on `stage` (comm ops: the group cost)."""
        return _kind_cost(self.at(stage, getattr(op, "chunk", 0)), type(op))

    @classmethod
    def from_trace(
        cls,
        trace: str | PathLike | Iterable[Mapping],
        *,
        unit_us: float = 1000.0,
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
            defaults: fields for kinds the trace does not show (e.g. `comm=0.1`).

        Raises:
            ScheduleConfigError: the file is not JSON or not a trace, an instruction event has
                a non-numeric `dur` or stage, or no event names an instruction.
            OSError: the file cannot be read.
        """
        events = _trace_events(trace)
        found = [(event, kind) for event in events if (kind := _kind_of(event)) is not None]
        by_pid = len({event.get("pid", 0) for event, _ in found}) > 1
        samples: dict[int, dict[str, list[float]]] = {}
        for event, kind in found:
            try:
                stage = int(event.get("pid", 0) if by_pid else event.get("tid", 0))
                duration = float(event["dur"]) / unit_us
            except (TypeError, ValueError):
                raise ScheduleConfigError(
                    f"trace event {event.get('name')!r}: its dur, pid and tid must be numbers"
                ) from None
            samples.setdefault(stage, {}).setdefault(kind, []).append(duration)
        if not samples:
            raise ScheduleConfigError(
                "the trace has no complete ('X') events named like instructions (F3, B3.1, ...)"
            )
        per_stage = {
            stage: cls(**{**defaults, **_medians(kinds)}) for stage, kinds in samples.items()
        }
        overall: dict[str, list[float]] = {}
        for kinds in samples.values():
            for kind, values in kinds.items():
                overall.setdefault(kind, []).extend(values)
        return cls(**{**defaults, **_medians(overall)}, per_stage=per_stage)


def _trace_events(trace: str | PathLike | Iterable[Mapping]) -> list:
    """The event list of a Chrome trace file, or the given events."""
    if not isinstance(trace, (str, PathLike)):
        return list(trace)
    try:
        data = json.loads(Path(trace).read_text())
    except json.JSONDecodeError as exc:
        raise ScheduleConfigError(f"trace {str(trace)!r} is not JSON: {exc}") from None
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ScheduleConfigError(
            f"trace {str(trace)!r}: expected a JSON list of events or an object with a "
            '"traceEvents" list'
        )
    return events


def _kind_of(event: object) -> str | None:
    if not isinstance(event, Mapping) or event.get("ph") != "X" or "dur" not in event:
        return None
    try:
        op = parse(str(event.get("name", "")))
    except ValueError:
        return None
    return "comm" if op.group == "comm" else _FIELD[op.code]


def _medians(kinds: Mapping[str, list[float]]) -> dict[str, float]:
    return {kind: float(statistics.median(values)) for kind, values in kinds.items()}


class Event(NamedTuple):
    """One instruction's time on its stage; a comm op spans its group's posted..done."""

    stage: int
    instruction: Instruction
    start: float
    end: float


@attrs.frozen(slots=True)
class _Run:
    """What `simulate` keeps to answer questions lazily: the steps, the pairing and the walk."""

    steps: Steps
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
        steps, walked = self._run.steps, self._run.walk
        events = []
        with paused_gc():
            for s, ops in enumerate(self.program.stages):
                starts, ends = walked.start[s], walked.end[s]
                for op, j in zip(ops, steps.step_at[s]):
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
            if e.instruction.code in _COMPUTE_CODES:
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
        """Per stage, the most microbatch activations held at once (+1 at F, -1 at B or I)."""
        peaks = []
        for ops in self.program.stages:
            held = peak = 0
            for op in ops:
                if op.code == "F":
                    held += 1
                    peak = max(peak, held)
                elif op.code in ("B", "I"):
                    held -= 1
            peaks.append(peak)
        return tuple(peaks)

    @cached_property
    def peak_versions(self) -> tuple[int, ...]:
        """Per stage, the most weight versions held at once.

        Version 0 is live from the start and version n from the n-th optimizer step; a version
        stays live while it is the newest or until its last use by a compute on the stage.
        """
        program = self.program
        versions = (program.versions or assign_versions(program).versions) or ()
        return tuple(_peak_live(ops, row) for ops, row in zip(program.stages, versions))

    @cached_property
    def critical_path(self) -> tuple[Event, ...]:
        """A chain of events, in time order, from time 0 to the makespan with no slack.

        Each event's start is set by the one before it: the previous step on its stage, or the
        partner group its comm group waited for. Empty for a measured timeline.
        """
        if self._run is None:
            return ()
        return _critical_path(self.program.stages, self._run)

    def summary(self) -> str:
        """One line: makespan, bubble and peak activations per stage."""
        peaks = " ".join(str(n) for n in self.peak_activations)
        return (
            f"makespan {self.makespan:g}, bubble {self.bubble_fraction:.1%}, "
            f"peak activations per stage [{peaks}], peak weight versions {max(self.peak_versions)}"
        )

    # -- drawing (schedcc.draw) -----------------------------------------------------------------

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
        from schedcc.draw.chrome import comm_flows, write_chrome_trace

        flows = comm_flows(self.program, self.events)
        return write_chrome_trace(self.events, path, flows=flows, metadata=_meta(self))


def _peak_live(ops, row) -> int:
    born = {0: -1}
    last_use: dict[int, int] = {}
    for pos, op in enumerate(ops):
        version = row[pos]
        if version is None:
            continue
        if op.code == "Step":
            born[version] = pos
        else:
            last_use[version] = pos
    deltas: dict[int, int] = {}
    for version, birth in born.items():
        newer = born.get(version + 1, len(ops))
        death = max(last_use.get(version, birth) + 1, newer)
        deltas[birth] = deltas.get(birth, 0) + 1
        deltas[death] = deltas.get(death, 0) - 1
    live = peak = 0
    for pos in sorted(deltas):
        live += deltas[pos]
        peak = max(peak, live)
    return peak


def _meta(timeline: Timeline) -> dict:
    schedule = timeline.program.schedule
    return {
        "schedule": schedule.name or type(schedule).__name__,
        "num_stages": schedule.num_stages,
        "num_microbatches": schedule.num_microbatches,
        "num_chunks": schedule.num_chunks,
        "num_batches": schedule.num_batches,
        "makespan": timeline.makespan,
        "bubble_fraction": timeline.bubble_fraction,
    }


def simulate(program: Program, costs: CostModel | None = None) -> Timeline:
    """Time `program` under `costs` on the step model the validator proves; linear.

    Args:
        program: a compiled program (`schedcc.compile`).
        costs: the cost model; `CostModel()` (F = 1, B = 2, I = W = 1, free comm) by default.

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
    stages = program.stages
    with paused_gc():
        steps = Steps.of(stages)
        partner, problems = match_comm(program, Layout.of(program.schedule))
        tables = _tables(costs, len(stages))
        durations = _durations(costs, tables, stages, steps)
        result = walk(steps, partner, lambda s, j: durations[s][j])
    if result.stuck or problems:
        _raise_invalid(program)
    return Timeline(program, costs=costs, run=_Run(steps, partner, result, tables))


def _tables(costs: CostModel, num_stages: int) -> list[dict | None]:
    """Per stage, the cost of each instruction class, or None where a per-chunk override can
    apply (then each op resolves its own model)."""
    tables: list[dict | None] = []
    for s in range(num_stages):
        model = costs.per_stage.get(s, costs)
        if model.per_chunk or (model is costs and costs.per_chunk):
            tables.append(None)
        else:
            tables.append({cls: _kind_cost(model, cls) for cls in _ALL_KINDS})
    return tables


def _durations(costs: CostModel, tables, stages, steps: Steps) -> list[list[float]]:
    """`durations[s][j]`: the cost of step j on stage s (one dict lookup per step, usually)."""
    out = []
    for s, ops in enumerate(stages):
        table, bounds = tables[s], steps.bounds[s]
        if table is None:
            out.append([costs.cost(s, ops[lo]) for lo, _ in bounds])
        else:
            out.append([table[type(ops[lo])] for lo, _ in bounds])
    return out


def _stage_busy(ops, run: _Run, s: int) -> float:
    """Compute time on stage s: counted by class when costs are per class, else summed."""
    table = run.tables[s]
    if table is not None:
        counts = Counter(map(type, ops))
        return sum(counts[cls] * table[cls] for cls in COMPUTE)
    starts, ends = run.walk.start[s], run.walk.end[s]
    return sum(
        ends[j] - starts[j]
        for j, (lo, _) in enumerate(run.steps.bounds[s])
        if ops[lo].group == "compute"
    )


def _raise_invalid(program: Program) -> None:
    from schedcc.validate import validate

    validate(program)  # raises the precise error
    raise DeadlockError("the program cannot run to the end; it does not validate")


def _critical_path(stages, run: _Run) -> tuple[Event, ...]:
    """Walk back from the step that ends last, always through the event that set each start."""
    steps, partner, walked = run.steps, run.partner, run.walk
    if not any(steps.bounds):
        return ()
    ends = [row[-1] if row else 0.0 for row in walked.end]
    s = max(range(len(ends)), key=lambda t: (ends[t], -t))
    j = len(steps.bounds[s]) - 1
    path: list[Event] = []
    at_done = True  # False: we reached this group at its posted event, through a partner
    while j >= 0:
        lo, hi = steps.bounds[s][j]
        start, end = walked.start[s][j], walked.end[s][j]
        path.extend(Event(s, stages[s][pos], start, end) for pos in reversed(range(lo, hi)))
        if at_done and steps.is_group[s][j]:
            best = None
            for pos in range(lo, hi):
                ps, ppos = partner[s][pos]
                pstep = steps.step_at[ps][ppos]
                posted = walked.start[ps][pstep]
                if posted > start and (best is None or posted > walked.start[best[0]][best[1]]):
                    best = (ps, pstep)
            if best is not None:
                s, j = best
                at_done = False
                continue
        at_done = True
        j -= 1
    path.reverse()
    return tuple(path)
