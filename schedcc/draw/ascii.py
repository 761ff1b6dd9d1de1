"""The terminal drawing: a row per stage, time running right.

Each compute is a block as wide as its duration (one column per time unit, or scaled to fit);
the block shows its kind and microbatch (`F3`, `B3`), with sequence parts its part too (`F3p1`:
microbatch 3 is part 1, [Note: sequence parts] in `schedcc.rules.parts`), or just the microbatch
or the kind letter when narrow. A block narrower than a column still marks that column when
nothing wider is drawn there, so busy time never reads as idle. Idle time is `.`. On a
terminal, blocks are coloured by kind (forward blue, backward green, input-grad cyan,
weight-grad magenta, updates yellow), brighter on odd chunks. A stage with offloads gets a
second row under it, its copy lane (`O3`, `L3`: [Note: offloading] in `schedcc.rules.offload`),
which runs beside its computes.

    >>> import schedcc
    >>> timeline = schedcc.simulate(schedcc.compile(schedcc.get_schedule("gpipe")(2, 2)))
    >>> print(timeline.to_ascii(color=False).splitlines()[1])
    stage 0 |F0 F1 .........B1    B0    |
"""

from __future__ import annotations

import os
import shutil
import sys

from schedcc.errors import ScheduleConfigError
from schedcc.ir import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Compute,
    Copy,
    Forward,
    GatherParams,
    GradNorm,
    Offload,
    OnMicrobatch,
    OptimizerStep,
    OverlappedBackward,
    Recompute,
    ReduceGrads,
    ReduceTied,
    Reload,
    Reshard,
    Unshard,
)

__all__ = ["render"]

#: The ANSI background of each drawn instruction class (comm is not drawn).
_BACKGROUND = {
    Forward: 44,
    Backward: 42,
    BackwardInput: 46,
    BackwardWeight: 45,
    Recompute: 41,
    OverlappedBackward: 42,
    ReduceGrads: 43,
    OptimizerStep: 43,
    GatherParams: 43,
    ReduceTied: 43,
    Unshard: 43,
    Reshard: 43,
    GradNorm: 43,
    Offload: 47,
    Reload: 47,
}
_RESET = "\x1b[0m"


def render(timeline, *, width: int | None = None, color: bool | None = None) -> str:
    """The drawing as text.

    Args:
        timeline: a `schedcc.simulate.Timeline`.
        width: the most columns for the time axis (default: the terminal's width).
        color: ANSI colours; default when stdout is a terminal and `NO_COLOR` is unset.

    Raises:
        ScheduleConfigError: `width` is less than 1.
    """
    if width is not None and width < 1:
        raise ScheduleConfigError(f"to_ascii: width must be at least 1 column, got {width}")
    if color is None:
        color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    makespan = timeline.makespan
    label = len(f"stage {timeline.num_stages - 1} |")
    if width is None:
        width = max(20, shutil.get_terminal_size((120, 24)).columns - label - 1)
    unit = _smallest_unit(timeline)
    scale = _scale(makespan, unit, width)
    columns = max(1, round(makespan * scale))
    rows = [[(".", None)] * columns for _ in range(timeline.num_stages)]
    lanes: dict[int, list] = {}  # the copy lane of each stage with copies
    parts = timeline.program.schedule.num_parts
    for stage, op, start, end in timeline.events:
        if type(op) not in _BACKGROUND or end <= start:
            continue
        if isinstance(op, Copy):
            row = lanes.setdefault(stage, [(".", None)] * columns)
            _draw(row, op, start * scale, end * scale, color)
            continue
        lo, hi = round(start * scale), round(end * scale)
        if hi <= lo:  # narrower than a column: shown only where nothing wider is
            col = min(int(start * scale), columns - 1)
            if rows[stage][col][1] is None:
                rows[stage][col] = (_block_text(op, 1, color, parts), _style(op))
            continue
        text = _block_text(op, hi - lo, color, parts)
        style = _style(op)
        for col in range(lo, min(hi, columns)):
            rows[stage][col] = (text[col - lo], style)
    lines = [_header(timeline, columns, scale)]
    for stage, row in enumerate(rows):
        lines.append(f"stage {stage}".ljust(label - 2) + " |" + _join(row, color) + "|")
        if stage in lanes:
            lines.append("  copy".ljust(label - 2) + " |" + _join(lanes[stage], color) + "|")
    return "\n".join(lines)


def _draw(row: list, op, lo_at: float, hi_at: float, color: bool) -> None:
    """One block of a copy lane, from column `lo_at` to `hi_at` (at least one column)."""
    lo = min(int(lo_at + 0.5), len(row) - 1)
    hi = min(max(int(hi_at + 0.5), lo + 1), len(row))
    text = _block_text(op, hi - lo, color)
    for col in range(lo, hi):
        row[col] = (text[col - lo], _style(op))


def _smallest_unit(timeline) -> float:
    """The shortest compute duration, so that it gets at least one column when it fits."""
    shortest = min(
        (
            e.end - e.start
            for e in timeline.events
            if isinstance(e.instruction, Compute) and e.end > e.start
        ),
        default=1.0,
    )
    return min(1.0, shortest)


def _scale(makespan: float, unit: float, width: int) -> float:
    """Columns per time unit: up to 3 per shortest compute, or whole time units per column."""
    if not makespan:
        return 1.0
    per_unit = min(3, int(width * unit // makespan)) / unit
    if per_unit >= 1 / unit:
        return per_unit
    return 1 / max(1.0, -(-makespan // width))


def _block_text(op, width: int, color: bool, parts: int = 1) -> str:
    """What a block shows: `F3.1`, `F3` or `3` (kind letter instead, when plain and narrow). A
    block on chunk c > 0 never drops its chunk (`F3` would read as chunk 0): `F3.1`, `3.1`, or
    the kind letter. With sequence parts the widest text adds the part: `F3p1`."""
    code, text = op.code, str(op)
    if not isinstance(op, OnMicrobatch):
        return code[:width].ljust(width, code[0])
    number = text[len(code) :]  # `3.1` or `3`: the printed form without its code
    texts = [text, number, code] if op.chunk else [text, number if color else code]
    if parts > 1:
        texts.insert(0, f"{text}p{op.microbatch % parts}")
    for text in texts:
        if len(text) <= width:
            return text.ljust(width)
    return code * width


def _style(op) -> int:
    background = _BACKGROUND[type(op)]
    return background + 60 if getattr(op, "chunk", 0) % 2 else background


def _join(row, color: bool) -> str:
    if not color:
        return "".join(char for char, _ in row)
    out, current = [], None
    for char, style in row:
        if style != current:
            out.append(_RESET if style is None else f"\x1b[30;{style}m")
            current = style
        out.append(" " if style is None and char == "." else char)
    out.append(_RESET)
    return "".join(out)


def _header(timeline, columns: int, scale: float) -> str:
    schedule = timeline.program.schedule
    name = schedule.name or type(schedule).__name__
    shape = f"p={schedule.num_stages} m={schedule.num_microbatches} v={schedule.num_chunks}"
    if schedule.num_parts > 1:
        shape += f" k={schedule.num_parts} parts"
    per = f"{1 / scale:g} time unit(s) per column" if scale else ""
    return f"{name} {shape}, makespan {timeline.makespan:g}, {per}, {columns} columns"
