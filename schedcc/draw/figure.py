"""The paper figure: a row per stage, a block per compute, coloured by kind, shaded by chunk.

Forward blocks are blue, backward green, input-grad (I) teal, weight-grad (W) purple and updates
grey; later chunks get lighter shades. A stage's copy lane (`Offload` brown, `Reload` tan) is a
thin strip right under its row, beside its computes. The block holds its microbatch
number where it fits; the title gives the schedule, p, m, v and the bubble. matplotlib is
imported only here, on use, with the Agg backend (no display needed).

    >>> import schedcc, tempfile, pathlib
    >>> timeline = schedcc.simulate(schedcc.compile(schedcc.get_schedule("1f1b")(4, 8)))
    >>> path = timeline.save(pathlib.Path(tempfile.mkdtemp()) / "1f1b.svg")
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path

from schedcc.errors import ScheduleConfigError
from schedcc.ir import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Copy,
    Forward,
    GatherParams,
    GradNorm,
    Offload,
    OptimizerStep,
    OverlappedBackward,
    Recompute,
    ReduceGrads,
    ReduceTied,
    Reload,
    Reshard,
    Unshard,
)

__all__ = ["save"]

#: Per drawn instruction class: its colour and its legend entry.
_COLOR = {
    Forward: (0.20, 0.42, 0.80),
    Backward: (0.22, 0.62, 0.30),
    BackwardInput: (0.10, 0.60, 0.62),
    BackwardWeight: (0.55, 0.33, 0.70),
    Recompute: (0.90, 0.55, 0.15),
    OverlappedBackward: (0.45, 0.70, 0.25),
    ReduceGrads: (0.55, 0.55, 0.55),
    OptimizerStep: (0.40, 0.40, 0.40),
    GatherParams: (0.65, 0.65, 0.65),
    ReduceTied: (0.50, 0.50, 0.50),
    Unshard: (0.75, 0.75, 0.75),
    Reshard: (0.85, 0.85, 0.85),
    GradNorm: (0.45, 0.45, 0.45),
    Offload: (0.60, 0.35, 0.15),
    Reload: (0.80, 0.65, 0.40),
}
_NAME = {
    Offload: "offload",
    Reload: "reload",
    Forward: "forward",
    Backward: "backward",
    BackwardInput: "input grad",
    BackwardWeight: "weight grad",
    Recompute: "recompute",
    OverlappedBackward: "overlapped backward",
    ReduceGrads: "reduce",
    OptimizerStep: "step",
    GatherParams: "gather",
    ReduceTied: "tied reduce",
    Unshard: "unshard",
    Reshard: "reshard",
    GradNorm: "grad norm",
}
_FORMATS = {".png": "png", ".svg": "svg"}
_MAX_LABELS = 4000  # beyond this many blocks, numbers would be unreadable anyway


def save(timeline, path: str | PathLike, *, title: str | None = None) -> Path:
    """Draw `timeline` into `path` (`.png` or `.svg`); returns the path.

    Raises:
        ScheduleConfigError: another suffix.
        OSError: the file cannot be written.
    """
    path = Path(path)
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ScheduleConfigError(
            f"cannot save a figure as {path.name!r}: use a .png or .svg file name"
        )
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    num_stages, makespan = timeline.num_stages, timeline.makespan or 1.0
    fig = Figure(figsize=(min(40.0, max(8.0, makespan / 4)), 1.0 + 0.45 * num_stages))
    ax = fig.add_subplot()
    blocks = [e for e in timeline.events if type(e.instruction) in _COLOR and e.end > e.start]
    schedule = timeline.program.schedule
    num_chunks = schedule.num_chunks
    label = len(blocks) <= _MAX_LABELS
    for stage, op, start, end in blocks:
        color = _shade(_COLOR[type(op)], getattr(op, "chunk", 0), num_chunks)
        if isinstance(op, Copy):  # the copy lane: a strip under the stage's computes
            ax.broken_barh([(start, end - start)], (stage + 0.42, 0.14), facecolors=color, zorder=3)
            continue
        ax.broken_barh(
            [(start, end - start)],
            (stage - 0.4, 0.8),
            facecolors=color,
            edgecolors="white",
            linewidth=0.5,
        )
        if label and hasattr(op, "microbatch"):
            ax.text(
                (start + end) / 2,
                stage,
                _label(op.microbatch, schedule.num_parts),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_yticks(range(num_stages), [f"stage {s}" for s in range(num_stages)])
    ax.set_ylim(num_stages - 0.5, -0.5)
    ax.set_xlim(0, makespan)
    ax.set_xlabel("time")
    ax.set_title(title or _title(timeline))
    ax.legend(handles=_legend(blocks), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format=fmt, dpi=120)
    return path


def _label(microbatch: int, parts: int) -> str:
    """A block's text: its microbatch, and with sequence parts its part (`3p1`)."""
    return f"{microbatch}p{microbatch % parts}" if parts > 1 else str(microbatch)


def _shade(rgb: tuple[float, float, float], chunk: int, num_chunks: int):
    """Lighter for later chunks: chunk 0 is the full colour."""
    mix = 0.5 * chunk / max(1, num_chunks - 1) if num_chunks > 1 else 0.0
    return tuple(c + (1.0 - c) * mix for c in rgb)


def _legend(blocks):
    from matplotlib.patches import Patch

    present = {type(e.instruction) for e in blocks}
    return [Patch(color=_COLOR[cls], label=_NAME[cls]) for cls in _COLOR if cls in present]


def _title(timeline) -> str:
    schedule = timeline.program.schedule
    name = schedule.name or type(schedule).__name__
    return (
        f"{name}: p={schedule.num_stages}, m={schedule.num_microbatches}, "
        f"v={schedule.num_chunks}, bubble {timeline.bubble_fraction:.1%}"
    )
