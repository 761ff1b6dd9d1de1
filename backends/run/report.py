"""What `schedcc run` shows: a progress bar while training and the summary table at the end.

The summary reads the measured instruction times every rank gathered to rank 0: the median step
time (the slowest rank's, barrier-aligned clocks) against the simulated one (`schedcc.simulate`
with `CostModel.from_trace` of the same run's events, as `--costs-from` reads its trace, timed as
the engine ran it: eagerly, as every transport posts and waits; see [Note: eager simulation]),
the throughput (what the timed steps' batches count for, tokens or samples, over their time),
the measured bubble (`Timeline.bubble_fraction` of the measured events) against the simulated
one, and each stage's peak activation memory.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from schedcc.draw.chrome import chrome_trace, comm_flows, cut_record, write_chrome_trace
from schedcc.program import Program
from schedcc.simulate import CostModel, Event, Timeline, simulate
from schedcc.sizes import format_size
from schedcc.tune import priced

__all__ = [
    "BYTES_OF",
    "Progress",
    "bytes_of",
    "check_line",
    "dropout_line",
    "measured_runs",
    "memory_record",
    "other_bytes",
    "steady_runs",
    "summarize",
]


class Progress:
    """A rich progress bar with the loss and the step time; a no-op when not `enabled`."""

    def __init__(self, total: int, *, enabled: bool = True, completed: int = 0):
        self.total, self.enabled, self.completed = total, enabled, completed
        self._bar = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]training"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("step {task.fields[step]}"),
                TextColumn("skipped {task.fields[skipped]}"),
                TextColumn("{task.fields[eval]}"),
                TimeElapsedColumn(),
            )
            self._bar.start()
            self._task = self._bar.add_task(
                "train",
                total=self.total,
                completed=self.completed,
                loss="-",
                step="-",
                skipped=0,
                eval="",
            )
        return self

    def advance(self, loss: float, seconds: float, *, skipped: int = 0) -> None:
        """One step done: move the bar and show this step's loss and time, and the steps
        skipped so far for non-finite gradients."""
        if self._bar is not None:
            self._bar.update(
                self._task,
                advance=1,
                loss=f"{loss:.4f}",
                step=f"{seconds * 1e3:.1f} ms",
                skipped=skipped,
            )

    def evaluated(self, loss: float) -> None:
        """Show the latest held-out loss beside the training loss."""
        if self._bar is not None:
            self._bar.update(self._task, eval=f"eval {loss:.4f}")

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


#: The steady runs (the last ones, after the first) a `--trace` holds, one after another: each
#: per-step kind (a step, a collective) measured that many times, not once.
TRACED_RUNS = 10


def measured_runs(program: Program, gathered: Sequence[dict]) -> list[list[tuple]]:
    """Per run of the program, the measured events of data-parallel replica 0, from time 0:
    `(stage, instruction, start, end, own)`, `own` the seconds a compute spent in its segment's
    own work ([Note: a compute's own time]), None for the other instructions."""
    from schedcc.backends.distributed.engine import unit_events

    bounds = _bounds(program)
    replica = [g for g in gathered if g["dp"] == 0]
    runs = []
    for r in range(len(replica[0]["times"])):
        events = []
        for payload in replica:
            stage = payload["stage"]
            ops, times, own = program.stages[stage], payload["times"][r], payload["segment"][r]
            events.extend(unit_events(stage, ops, bounds[stage], times, own))
        origin = min(e[2] for e in events)
        runs.append([(s, op, a - origin, b - origin, own) for s, op, a, b, own in events])
    return runs


def steady_runs(first: int, kept: int) -> list[int]:
    """Which of `kept` runs (the first of them run `first` of the job) the summary reads: all
    but the job's first run, unless that is the only one.

    >>> steady_runs(0, 4), steady_runs(0, 1), steady_runs(5, 3)
    ([1, 2, 3], [0], [0, 1, 2])
    """
    if first == 0 and kept > 1:
        return list(range(1, kept))
    return list(range(kept))


def _bounds(program: Program):
    from schedcc.semantics import Units

    return Units.of(program.stages).bounds


def _run_seconds(gathered: Sequence[dict], run: int) -> float:
    starts = [g["times"][run][0][0] for g in gathered if g["times"][run]]
    ends = [g["times"][run][-1][1] for g in gathered if g["times"][run]]
    return max(ends) - min(starts)


def summarize(
    program: Program,
    config,
    model,
    losses: list[float],
    sizes: list[int],
    gathered,
    evals: Sequence[tuple[int, float]] = (),
) -> None:
    """Print the summary table (and write the trace) on rank 0.

    `model` is the run's `RunModel`; `losses` and `sizes` hold, per step this process trained,
    its loss and what its global batch counts for (`RunModel.size`); `evals` the `(step,
    loss)` of each evaluation on held-out batches.
    """
    import torch
    from rich.console import Console
    from rich.table import Table

    own_runs = measured_runs(program, gathered)  # each compute with its own time
    runs = [[Event(*event[:4]) for event in run] for run in own_runs]
    first = gathered[0]["first"]  # the run the engines' kept times start at
    steady = steady_runs(first, len(runs))
    per_run = config.num_batches
    run_seconds = statistics.median(_run_seconds(gathered, r) for r in steady)
    step_seconds = run_seconds / per_run
    counted = sum(sizes[(first + r) * per_run + b] for r in steady for b in range(per_run))
    rate = counted / sum(_run_seconds(gathered, r) for r in steady)
    measured = statistics.median(Timeline(program, tuple(runs[r])).bubble_fraction for r in steady)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # as the job chose
    simulated = _simulated(program, _one_after_another([own_runs[r] for r in steady]), device)
    peaks = {g["stage"]: g["peak"] for g in gathered if g["dp"] == 0}
    if config.trace:
        traced = steady[-TRACED_RUNS:]
        laid = _one_after_another([runs[r] for r in traced])
        write_chrome_trace(
            _one_after_another([own_runs[r] for r in traced]),
            config.trace,
            flows=comm_flows(program, laid),  # the last run's: each op's last event
            metadata={
                "runs": len(traced),
                "schedule": repr(program.schedule),
                "measured": True,
                "device": device,
                "cut": cut_record(program.schedule),
                "updates": {"tied": [list(g) for g in config.tied], "grad_norm": program.grad_norm},
                **memory_record(program, config, gathered),
            },
            unit_us=1e6,
        )
    table = Table(
        title=f"schedcc run: {program.schedule!r}, dp={config.data_parallel}, "
        f"zero={config.zero}, " + (f"tp={config.tp}, " if config.tp > 1 else "") + config.model
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("steps", str(len(losses)))
    table.add_row("loss: first -> final", f"{losses[0]:.4f} -> {losses[-1]:.4f}")
    if evals:
        (first_step, first), (last_step, last) = evals[0], evals[-1]
        table.add_row(f"eval loss: step {first_step} -> {last_step}", f"{first:.4f} -> {last:.4f}")
    if model.floor is not None:
        table.add_row(f"loss {model.floor_name}", f"{model.floor:.4f}")
    for row in _training_rows(config, gathered):
        table.add_row(*row)
    step = f"{step_seconds * 1e3:.2f}"
    if simulated is None:
        table.add_row("median step time", f"{step} ms")
    else:
        table.add_row(
            "median step time: measured / simulated",
            f"{step} / {simulated.makespan / per_run:.2f} ms",
        )
    table.add_row(f"{model.unit}/s", f"{rate:,.0f}")
    bubble = math.nan if simulated is None else simulated.bubble_fraction
    table.add_row("bubble: measured / simulated", f"{measured:.1%} / {bubble:.1%}")
    table.add_row("point-to-point", _transports(gathered))
    if program.tied:
        groups = ", ".join(str(group) for group in program.tied)
        table.add_row("tied segments (ReduceTied)", groups)
    for stage in sorted(peaks):
        table.add_row(f"peak activations, stage {stage}", format_size(peaks[stage]))
    if config.trace:
        table.add_row("trace", config.trace)
    Console().print(table)


# [Note: a trace's bytes] A run's trace records, per segment of one model replica of the run's cut
# (model order, p·v / R of them), the most one microbatch's forward saved for its backward and
# the bytes its input took, under "otherData" -> "memory": {"activations": [...], "inputs":
# [...]}, and the cut under "cut" ([Note: a trace's cut] in `schedcc.costs`). They are measured
# as the "peak activations" rows count (`backends.runtime.graphs`), so `MemoryModel.from_trace`
# reads them back as a model in which a byte limit is one on those rows: `schedcc run --schedule
# search --search-memory-limit 40MiB` searches within 40 MiB of activations a stage and the
# run's own rows show that the order kept to it. Parameters, gradients and optimizer state are
# left out (the limit is on activations alone, as on a device whose static bytes are known).
# The sizes hold for what the run trained: the record names it (`BYTES_OF`: the model, the
# microbatch size, the dtype, as `--check` trains in float64, twice fp32's bytes, the tensor
# parallel degree, layer recomputation, torch.compile), and the closed loop refuses a trace of
# another. And they hold for the cut they were measured on ([Note: a measured cut] in
# `schedcc.memory_model`): a search counts them for orders that cut the model the same way. A
# run with sequence parts records none: its graphs are a part's, and a search counts whole
# microbatches.

#: What a microbatch's bytes depend on besides the cut: the run's fields a trace records beside
#: them, and the flag that sets each ([Note: a trace's bytes]).
BYTES_OF = {
    "model": "--model",
    "microbatch_size": "--microbatch-size",
    "dtype": "--precision; --check trains in float64",
    "tp": "--tp",
    "recompute_layers": "--recompute-layers",
    "compile": "--compile",
}


def memory_record(program: Program, config, gathered) -> dict:
    """The trace's `"memory"` record ([Note: a trace's bytes]): none for a run with sequence
    parts, whose graphs each hold one part's activations, not a microbatch's."""
    schedule = program.schedule
    if schedule.num_parts > 1:
        return {}
    length = schedule.num_segments // type(schedule).num_replicas
    return {"memory": {**_microbatch_bytes(gathered, length), **bytes_of(config)}}


def bytes_of(config) -> dict:
    """What a run's microbatch bytes depend on besides the cut (`BYTES_OF`), from its `Config`
    or its `schedcc run` arguments."""
    return {
        "model": config.model,
        "microbatch_size": config.microbatch_size,
        "dtype": "float64" if config.check else config.precision,
        "tp": config.tp or 1,
        "recompute_layers": config.recompute_layers,
        "compile": config.compile,
    }


def other_bytes(trace: str, recorded: Mapping, config) -> str | None:
    """Why the bytes `trace` recorded (its `"memory"` record) do not hold for a run of `config`
    (`bytes_of`), or None ([Note: a trace's bytes])."""
    ours = bytes_of(config)
    for key, flag in BYTES_OF.items():
        if key in recorded and recorded[key] != ours[key]:
            return (
                f"{trace} measured bytes of a run with {key} = {recorded[key]!r} ({flag}), this "
                f"one has {ours[key]!r}: trace the first run as this one trains"
            )
    return None


def _microbatch_bytes(gathered, length: int) -> dict[str, list[int]]:
    """Per segment of one replica (the first `length`), one microbatch's activation and input
    bytes ([Note: a trace's bytes])."""
    sizes = {k: size for g in gathered if g["dp"] == 0 for k, size in g["sizes"].items()}
    segments = sorted(k for k in sizes if k < length)
    return {field: [sizes[k][field] for k in segments] for field in ("activations", "inputs")}


def _training_rows(config, gathered) -> list[tuple[str, str]]:
    """A dict loss's last parts, the precision, the last gradient norm and skipped steps."""
    rows = []
    metrics = next((g["metrics"] for g in gathered if len(g.get("metrics", {})) > 1), {})
    rows += [(f"loss part {name}: final", f"{value:.4f}") for name, value in metrics.items()]
    rows.append(("precision", config.precision))
    norm = gathered[0].get("norm")
    if norm is not None:
        clip = f" (max {config.max_grad_norm:g})" if config.max_grad_norm else ""
        rows.append(("grad norm: last", f"{norm:.4g}{clip}"))
        rows.append(("skipped steps (inf/nan)", str(gathered[0]["skipped"])))
    return rows


def _one_after_another(runs: Sequence[list[tuple]]) -> list[tuple]:
    """The events of `runs` (each from time 0; `Event`s, or `measured_runs`' with a fifth
    element) on one clock, each run after the last one's end: so each stage's runs read apart,
    split at its steps ([Note: a step's first computes] in `schedcc.costs`)."""
    out, offset = [], 0.0
    for events in runs:
        out.extend(_shifted(e, offset) for e in events)
        offset += max((e[3] for e in events), default=0.0)
    return out


def _shifted(event: tuple, offset: float) -> tuple:
    """`event` `offset` later, of its own type."""
    stage, op, start, end, *rest = event
    moved = (stage, op, start + offset, end + offset, *rest)
    return Event(*moved) if isinstance(event, Event) else moved


def _simulated(program: Program, events: list[tuple], device: str = "cpu") -> Timeline | None:
    """The program simulated eagerly (as the engine runs it) under the costs its own measured
    events give (`measured_runs`': each compute's own time, each receive's take), read as
    `CostModel.from_trace` reads the trace `--trace` writes of them (in milliseconds; each
    segment its own measured costs, an overlapped pair read as run on `device`), priced per
    chunk as `tune` prices them ([Note: tune's units]); None when no event times an
    instruction."""
    if not events:
        return None
    samples = chrome_trace(events, unit_us=1e6)["traceEvents"]
    schedule = program.schedule
    metadata = {"measured": True, "device": device, "cut": cut_record(schedule)}
    costs = CostModel.from_trace({"traceEvents": samples, "otherData": metadata})
    return simulate(program, priced(costs, schedule), eager=True)


def _transports(gathered) -> str:
    """How the stages' tensors travelled: one word if every rank says the same."""
    kinds = sorted({g["p2p"] for g in gathered})
    if len(kinds) == 1:
        return kinds[0]
    counts = {kind: sum(g["p2p"] == kind for g in gathered) for kind in kinds}
    return ", ".join(f"{kind} on {n} rank(s)" for kind, n in counts.items())


def check_line(
    worst: float, tolerance: float, *, what: str = "largest parameter", objective: str = ""
) -> str:
    """The `--check` verdict, one line; `objective` names what both trained (`reference.
    OBJECTIVES`); a failure of a ratio divided at the step names the fix.

    >>> check_line(2e-16, 1e-9, objective="per-microbatch means")
    'check: largest parameter difference from non-pipelined training 2e-16 (tolerance 1e-09, \
objective: per-microbatch means): ok'
    """
    from schedcc.backends.reference import OBJECTIVES
    from schedcc.backends.runtime.losses import RATIO

    verdict = "ok" if worst <= tolerance else "FAILED"
    trained = f", objective: {objective}" if objective else ""
    line = (
        f"check: {what} difference from non-pipelined training {worst:.3g} "
        f"(tolerance {tolerance:g}{trained}): {verdict}"
    )
    if worst > tolerance and objective == OBJECTIVES[RATIO]:
        line += (
            "; a model that rounds in float32 inside matches only with the count known up "
            "front: give the loss as schedcc.TokenLoss(sum_fn, count_fn)"
        )
    return line


def dropout_line(dropped: Sequence[str], *, shown: int = 3) -> str:
    """What `--check` turned off (`reference.without_dropout`), one line naming the first few.

    >>> dropout_line(["segment 0 drop (p=0.1)"])
    'check: dropout set to 0 for the run and the reference in 1 place(s), segment 0 drop \
(p=0.1) (masks drawn per stage and microbatch cannot match non-pipelined training)'
    """
    named = ", ".join(dropped[:shown]) + (", ..." if len(dropped) > shown else "")
    return (
        f"check: dropout set to 0 for the run and the reference in {len(dropped)} place(s), "
        f"{named} (masks drawn per stage and microbatch cannot match non-pipelined training)"
    )
