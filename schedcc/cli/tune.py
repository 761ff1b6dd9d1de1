"""`schedcc tune`: rank every schedule over a grid of shapes under a memory limit.

A thin wrapper of `schedcc.tune` (see its [Note: tune's units]): the arguments in, a table or
JSON out. Exit 1 when nothing fits the memory limit.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

from schedcc.cli import args as shared
from schedcc.cli import memory_flags
from schedcc.cli.args import UsageError
from schedcc.costs import (
    CostModel,
    MeasuredUpdates,
    measured_backward,
    measured_updates,
)
from schedcc.registry import get_schedule, registered_classes
from schedcc.sizes import format_size
from schedcc.tune import TuneResult, tune

__all__ = [
    "add_stage_costs",
    "add_updates",
    "costs_of",
    "finer_line",
    "ranking_table",
    "register",
    "run",
    "updates_line",
    "updates_of",
]

EPILOG = """examples:
  schedcc tune -p 8 -m 8,16,32
  schedcc tune -p 4 -m 8,16 -v 1,2 --memory-limit 4 --costs F=1,B=2,I=1,W=1
  schedcc tune -p 4 -m 8 --costs-from trace.json --dp 2 --zero 1 --format json
  schedcc tune -p 4 -m 8 --costs F=1,B=2,reduce=0.5,norm=0.2 --tied 0,-1 --grad-norm
  schedcc tune -p 4 -m 8 --schedule my_schedules.py:MySchedule
  schedcc tune -p 4 -m 8 -v 1,2,4 --costs F=1,B=2,comm=0.1 --eager
  schedcc tune -p 4 -m 8,16 --recompute --memory act=256MiB,params=2GiB,opt=4GiB \
      --memory-limit 12GiB
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tune",
        help="rank every schedule over a grid of shapes under a memory limit",
        description="Simulate every registered schedule (and your own) over a grid of shapes, "
        "drop those over the activation-memory limit and rank the rest by time per microbatch.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    shared.add_stages(parser, required=True)
    shared.add_microbatches(parser, default=[8], many=True)
    shared.add_chunks(parser, many=True)
    memory_flags.add_memory(
        parser,
        limit=True,
        recompute_help="also rank every shape with full recomputation (compile(..., "
        "recompute=True))",
    )
    add_stage_costs(parser)
    shared.add_parallel(parser)
    add_updates(parser)
    shared.add_schedule(parser, many=True)
    shared.add_eager(parser, what="time every program")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.set_defaults(func=run)


def add_stage_costs(parser) -> None:
    """`--costs K=V,...`, `--segment-costs K=V,...;...` and `--costs-from TRACE` (read together
    by `costs_of`)."""
    shared.add_costs(
        parser, default=None, help="per-stage costs at v = 1, e.g. F=1,B=2,I=1,W=1,comm=0.1"
    )
    shared.add_segment_costs(parser)
    parser.add_argument(
        "--costs-from",
        type=Path,
        default=None,
        metavar="TRACE",
        help="measured costs from a Chrome trace of a run (--costs fills kinds it lacks)",
    )
    add_other_cut(parser)


def add_other_cut(parser) -> None:
    """`--other-cut TRACE`, repeatable: runs of the same model at other cuts, from which
    `CostModel.from_trace` reads each compute's per-call part ([Note: a compute's per-call
    time] in `schedcc.costs`)."""
    parser.add_argument(
        "--other-cut",
        type=Path,
        action="append",
        default=[],
        metavar="TRACE",
        help="with --costs-from: a trace of the same model at another -v (e.g. interleaved-1f1b "
        "-v 2 beside 1f1b), so orders at either cut are priced with what a compute costs "
        "whatever its chunk (repeatable)",
    )


def trace_costs(args, num_stages: int, **defaults: float) -> CostModel:
    """The costs measured in `--costs-from`, with `--other-cut`'s per-call part."""
    return CostModel.from_trace(
        args.costs_from, num_stages=num_stages, other_cuts=args.other_cut, **defaults
    )


def add_updates(parser) -> None:
    """`--tied GROUPS` and `--grad-norm`: the updates every program carries (read from a
    `--costs-from` trace of `schedcc run` by default, `updates_of`)."""
    parser.add_argument(
        "--tied",
        type=_tied_groups,
        default=None,
        metavar="K,K[;...]",
        help="segments that share parameters, summed by a ReduceTied (priced reduce=): e.g. "
        "0,-1 for an LM head tied to the embedding (-1 the last segment, at any cut); default: "
        "with --costs-from, the ties of the run it traced, else none",
    )
    parser.add_argument(
        "--grad-norm",
        action="store_true",
        default=None,
        help="every program takes the global gradient norm (a GradNorm, priced norm=), as "
        "clipping needs; default: with --costs-from, as the run it traced did, else not",
    )


def _tied_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """`--tied 0,-1;2,5` as groups of segment indices."""
    try:
        return tuple(
            tuple(int(k) for k in group.split(",")) for group in text.split(";") if group.strip()
        )
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give groups of segment indices, e.g. 0,-1 or 0,5;1,4"
        ) from None


def updates_line(tied, grad_norm: bool) -> str | None:
    """A line naming the updates every program was timed with, where there are any."""
    said = [f"tied {', '.join(map(str, tied))}"] if tied else []
    said += ["the gradient norm"] if grad_norm else []
    if not said:
        return None
    return f"every program timed with its updates' collectives: {' and '.join(said)}"


def updates_of(args) -> dict:
    """`tied=` and `grad_norm=` for `schedcc.tune` and `schedcc.search`: the flags, else what
    the `--costs-from` trace's run compiled ([Note: a trace's updates] in `schedcc.costs`)."""
    traced = MeasuredUpdates() if args.costs_from is None else measured_updates(args.costs_from)
    return {
        "tied": traced.tied if args.tied is None else args.tied,
        "grad_norm": traced.grad_norm if args.grad_norm is None else args.grad_norm,
    }


def run(args) -> int:
    shared.check_size(args.num_stages, max(args.num_microbatches), max(args.num_chunks or [2]))
    memory = memory_flags.memory_of(args)
    costs = memory_flags.with_memory(costs_of(args), memory)
    updates = updates_of(args)
    result = tune(
        _with_registered(args.schedule) if args.schedule else None,
        num_stages=args.num_stages,
        num_microbatches=args.num_microbatches,
        num_chunks=args.num_chunks,
        costs=costs,
        memory_limit=args.memory_limit,
        data_parallel=args.dp,
        zero=args.zero,
        **updates,
        recompute=(False, True) if args.recompute else False,
        eager=args.eager,
    )
    if args.format == "json":
        print(json.dumps(result.to_dict(), indent=2))
    else:
        notes = (
            memory_flags.cut_line(memory, args.num_stages),
            guessed_line(args.costs_from, args.costs),
            finer_line(costs, args.num_stages, (c.num_chunks for c in result.ranked)),
            updates_line(**updates),
        )
        print("\n".join([ranking_table(result), *filter(None, notes)]))
    return 0 if result.ranked else 1


def _with_registered(extra: list[str]) -> dict:
    """Every registered schedule, then the `--schedule` ones under the names given."""
    return {**registered_classes(), **{name: get_schedule(name) for name in extra}}


def costs_of(args) -> CostModel:
    """`--costs`, with `--segment-costs` each segment's own ([Note: segment costs]); or the
    costs measured in `--costs-from` (a run of `-p` stages) with `--costs` filling the kinds the
    trace lacks."""
    given, trace, num_stages = args.costs, args.costs_from, args.num_stages
    if trace is not None and args.segment_costs is not None:
        raise UsageError(
            "--segment-costs and --costs-from both give each segment's costs: give one"
        )
    segments = args.segment_costs
    if segments is not None and len(segments) % num_stages:
        raise UsageError(
            f"--segment-costs gives {len(segments)} segments, which {num_stages} stages do not "
            f"share: give p * v of them ({num_stages} at v = 1, {2 * num_stages} at v = 2)"
        )
    if trace is None:
        if args.other_cut:
            raise UsageError("--other-cut goes with --costs-from TRACE (the run it prices)")
        return shared.with_segments(given or CostModel(), segments, num_stages)
    defaults = {name: getattr(given, name) for name in args.costs_named}  # the named ones only
    return trace_costs(args, num_stages, **defaults)


def guessed_line(trace: Path | None, given: CostModel | None) -> str | None:
    """A line where the costs of F/I/W orders are a guess: a trace of whole backwards only,
    read as I = W = B / 2 ([Note: a trace's backward both ways])."""
    if trace is None or given is not None or measured_backward(trace) != (False,):
        return None
    return (
        f"{trace} measured whole backwards only: I and W are read as B / 2, so orders that "
        "split them (zb-h1, ...) rank ahead of what they measure (a trace of one, e.g. "
        "schedcc run --schedule zb-h1 --trace, times them)"
    )


def finer_line(costs: CostModel, num_stages: int, chunks: Iterable[int]) -> str | None:
    """A line where some of `chunks` cut a stage finer than the costs' segments were measured:
    no segment's split is known, so those orders are priced from each stage's costs divided
    among its chunks ([Note: segment costs]); None where every order is priced per segment."""
    finest = max(len(table) for table in (costs.per_segment, *costs.other_segments))
    measured, left = divmod(finest, num_stages)
    if not measured or left or all(v <= measured for v in chunks):
        return None
    return (
        f"costs per segment of a cut in {finest} (v = {measured}): orders at "
        f"v <= {measured} (and DualPipe's replicas of that cut) are priced segment by segment, "
        "those at more chunks a stage from each stage's costs divided among its chunks, a guess "
        "where segments differ (the costs of p * v segments price them, or a trace of a run at "
        "that v as --costs-from, with this one as --other-cut)"
    )


def ranking_table(result: TuneResult) -> str:
    """The ranking as a table, then what went over the limit and how many shapes were skipped."""
    header = (
        "#",
        "schedule",
        "m",
        "v",
        "makespan (eager)" if result.eager else "makespan",
        "per mb",
        "bubble",
        "peak act",
        "act per stage",
        "versions per stage",
    )
    in_bytes = any(c.peak_bytes is not None for c in (*result.ranked, *result.over_limit))
    if any(c.recompute for c in (*result.ranked, *result.over_limit)):
        header = (*header[:4], "recompute", *header[4:])
    if in_bytes:
        header = (*header, "peak bytes")
    rows = [
        (
            str(rank),
            c.schedule,
            str(c.num_microbatches),
            str(c.num_chunks),
            f"{c.makespan:g}",
            f"{c.time_per_microbatch:.3f}",
            f"{100 * c.bubble:.1f}%",
            f"{c.peak_activations:g}",
            " ".join(f"{n:g}" for n in c.activations),
            " ".join(str(n) for n in c.versions),
        )
        for rank, c in enumerate(result.ranked, 1)
    ]
    if "recompute" in header:
        rows = [
            (*row[:4], "yes" if c.recompute else "no", *row[4:])
            for row, c in zip(rows, result.ranked)
        ]
    if in_bytes:
        rows = [(*row, format_size(c.peak_bytes or 0)) for row, c in zip(rows, result.ranked)]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]
    ]
    if not rows:
        lines = ["no schedule fits: every shape was skipped or over the memory limit"]
    if result.over_limit:
        dropped = ", ".join(
            f"{c.schedule} m={c.num_microbatches} v={c.num_chunks}"
            f"{' recompute' if c.recompute else ''} ({_held(c)})"
            for c in result.over_limit
        )
        lines.append(f"over the memory limit: {dropped}")
    if result.skipped:
        lines.append(
            f"skipped {len(result.skipped)} shapes a schedule rejects or measured bytes do not "
            "hold for (--format json lists why)"
        )
    return "\n".join(lines)


def _held(c) -> str:
    """What a candidate holds at its peak, as the memory limit counts it."""
    return format_size(c.peak_bytes) if c.peak_bytes is not None else f"{c.peak_activations:g}"
