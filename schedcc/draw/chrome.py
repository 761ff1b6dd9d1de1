"""Chrome traces (Trace Event Format): open them in https://ui.perfetto.dev or chrome://tracing.

One writer for simulated and measured timelines: `write_chrome_trace(events, path)` takes any
iterable of `(stage, instruction, start, end)` and writes a track per stage (pid 0, tid = stage;
a stage's copies, which overlap its computes, on a track of their own, "stage s copy"),
a complete event ("X") per instruction named by its `str` with its microbatch and chunk in
`args`, and, when given, flow arrows ("s"/"f") from each send to its receive.

    >>> import schedcc, tempfile, pathlib
    >>> timeline = schedcc.simulate(schedcc.compile(schedcc.get_schedule("1f1b")(2, 2)))
    >>> path = timeline.to_chrome_trace(pathlib.Path(tempfile.mkdtemp()) / "1f1b.json")
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from os import PathLike
from pathlib import Path

from schedcc.errors import ScheduleConfigError
from schedcc.ir import SENDS, Comm, Instruction

__all__ = [
    "chrome_trace",
    "comm_flows",
    "cut_record",
    "read_chrome_trace",
    "save",
    "track_stage",
    "write_chrome_trace",
]

_CATEGORY = {"compute": "compute", "comm": "comm", "update": "update", "copy": "copy"}
#: The copy lane of stage s is track `_COPY_TRACK + s`.
_COPY_TRACK = 1_000_000

EventLike = Sequence  # (stage, instruction, start, end), or with the stage's own time fifth


def chrome_trace(
    events: Iterable[EventLike],
    *,
    flows: Iterable[tuple[EventLike, EventLike]] = (),
    metadata: Mapping | None = None,
    unit_us: float = 1000.0,
) -> dict:
    """The trace as a JSON-ready dict (`{"traceEvents": [...], "otherData": metadata}`).

    Args:
        events: `(stage, instruction, start, end)` tuples; times in any unit. A fifth element,
            where not None, is a measured run's own time of the stage in it: a compute's in
            its segment's own work ([Note: a compute's own time]), written as the event's
            `"segment_us"`; a receive's in taking its message once it had come ([Note: a
            receive's take] in `schedcc.costs`), written as its `"take_us"`. Both are what
            `CostModel.from_trace` reads.
        flows: `(send event, receive event)` pairs to join with arrows.
        metadata: put under "otherData" (schedule, shape, bubble, ...).
        unit_us: microseconds per time unit: 1000 draws a simulated cost unit as 1 ms; a
            measured run in seconds passes 1e6.
    """
    out: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "pipeline"}},
    ]
    stages: set[int] = set()
    for stage, op, start, end, *own in events:
        tid = stage + _COPY_TRACK if op.group == "copy" else stage
        stages.add(tid)
        args = _args(op)
        if own and own[0] is not None:  # a compute's own time, or a receive's take
            field = "take_us" if op.group == "comm" else "segment_us"
            args[field] = round(own[0] * unit_us, 3)
        out.append(
            {
                "name": str(op),
                "cat": _CATEGORY.get(op.group, "other"),
                "ph": "X",
                "pid": 0,
                "tid": tid,
                "ts": round(start * unit_us, 3),
                "dur": round(max(0.0, end - start) * unit_us, 3),
                "args": args,
            }
        )
    for stage in sorted(stages):  # a track: a stage, or a stage's copy lane
        out.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 0,
                "tid": stage,
                "args": {"name": _track_name(stage)},
            }
        )
        out.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": 0,
                "tid": stage,
                "args": {"sort_index": stage},  # copy lanes after the stages
            }
        )
    for n, (send, recv) in enumerate(flows):
        s_stage, s_op, s_start, _ = send
        r_stage, r_op, r_start, r_end = recv
        land = min(max(s_start, r_start), r_end)
        common = {"name": f"{s_op}->{r_op}", "cat": "flow", "id": n, "pid": 0}
        out.append({**common, "ph": "s", "tid": s_stage, "ts": round(s_start * unit_us, 3)})
        out.append({**common, "ph": "f", "bp": "e", "tid": r_stage, "ts": round(land * unit_us, 3)})
    trace: dict = {"traceEvents": out, "displayTimeUnit": "ms"}
    if metadata:
        trace["otherData"] = dict(metadata)
    return trace


def track_stage(tid: int) -> int:
    """The stage a track (`tid`) belongs to: its own, or the stage whose copy lane it is."""
    return tid - _COPY_TRACK if tid >= _COPY_TRACK else tid


def _track_name(tid: int) -> str:
    if tid >= _COPY_TRACK:
        return f"stage {tid - _COPY_TRACK} copy"
    return f"stage {tid}"


def write_chrome_trace(
    events: Iterable[EventLike],
    path: str | PathLike,
    *,
    flows: Iterable[tuple[EventLike, EventLike]] = (),
    metadata: Mapping | None = None,
    unit_us: float = 1000.0,
) -> Path:
    """Write `chrome_trace(...)` to `path` as JSON; returns the path.

    Raises:
        OSError: the file cannot be written.
    """
    path = Path(path)
    trace = chrome_trace(events, flows=flows, metadata=metadata, unit_us=unit_us)
    path.write_text(json.dumps(trace, separators=(",", ":")))
    return path


def read_chrome_trace(
    trace: str | PathLike | Mapping | Iterable[Mapping],
) -> tuple[list, Mapping]:
    """The event list of a Chrome trace file, or of its parsed object (`{"traceEvents": [...],
    "otherData": {...}}`), or the given events, and its "otherData" ({} for events given, or a
    trace without it).

    Raises:
        ScheduleConfigError: the file is not JSON, or holds no list of events.
        OSError: the file cannot be read.
    """
    if isinstance(trace, Mapping):
        data = trace
    elif not isinstance(trace, (str, PathLike)):
        return list(trace), {}
    else:
        try:
            data = json.loads(Path(trace).read_text())
        except json.JSONDecodeError as exc:
            raise ScheduleConfigError(f"trace {str(trace)!r} is not JSON: {exc}") from None
    events = data.get("traceEvents", []) if isinstance(data, Mapping) else data
    if not isinstance(events, list):
        where = repr(str(trace)) if isinstance(trace, (str, PathLike)) else "(object)"
        raise ScheduleConfigError(
            f"trace {where}: expected a JSON list of events or an object with a "
            '"traceEvents" list'
        )
    metadata = data.get("otherData", {}) if isinstance(data, Mapping) else {}
    return events, metadata if isinstance(metadata, Mapping) else {}


def save(timeline, path: str | PathLike) -> Path:
    """Write `timeline`'s trace to `path` (`Timeline.to_chrome_trace`): its events, an arrow
    from each send to its receive, and the schedule's shape, makespan and bubble as metadata.

    Raises:
        OSError: the file cannot be written.
    """
    schedule = timeline.program.schedule
    metadata = {
        "schedule": schedule.name or type(schedule).__name__,
        "num_stages": schedule.num_stages,
        "num_microbatches": schedule.num_microbatches,
        "num_chunks": schedule.num_chunks,
        "num_batches": schedule.num_batches,
        "num_parts": schedule.num_parts,
        "makespan": timeline.makespan,
        "bubble_fraction": timeline.bubble_fraction,
        "cut": cut_record(schedule),
    }
    flows = comm_flows(timeline.program, timeline.events)
    return write_chrome_trace(timeline.events, path, flows=flows, metadata=metadata)


def cut_record(schedule) -> dict:
    """A trace's `"cut"`: the stages, chunks per stage and model replicas of the program it
    times, and the segment each stage's chunk runs (`CostModel.from_trace` reads its costs per
    stage and per segment with it, [Note: a trace's cut], [Note: segment costs])."""
    return {
        "num_stages": schedule.num_stages,
        "num_chunks": schedule.num_chunks,
        "num_replicas": type(schedule).num_replicas,
        "segments": [list(row) for row in schedule.segment_table()],
    }


def comm_flows(program, events: Iterable[EventLike]) -> list[tuple[EventLike, EventLike]]:
    """`(send, receive)` event pairs of `program`'s matched comm ops, found among `events`.

    Works for a measured run too: events are looked up by `(stage, instruction)`, in any order;
    a pair with a side missing from `events` is left out.
    """
    by_op = {(e[0], e[1]): e for e in events if isinstance(e[1], Comm)}
    partner = program.rendezvous_model.partner
    pairs = []
    for s, row in enumerate(partner):
        ops = program.stages[s]
        for pos, peer in enumerate(row):
            if peer is None or not isinstance(ops[pos], SENDS):
                continue
            send = by_op.get((s, ops[pos]))
            recv = by_op.get((peer[0], program.stages[peer[0]][peer[1]]))
            if send is not None and recv is not None:
                pairs.append((send, recv))
    return pairs


def _args(op: Instruction) -> dict:
    args = {"kind": type(op).__name__}
    if hasattr(op, "microbatch"):
        args["microbatch"] = op.microbatch
    if hasattr(op, "chunk"):
        args["chunk"] = op.chunk
    return args
