"""`schedcc search`: find an order for a shape, its costs and memory limit; rank it and write it.

A thin wrapper of `schedcc.search` ([Note: the search]): the found order's line (makespan,
lower bound, where it came from), `schedcc tune`'s ranking of it against every built-in at the
same limit, its drawing, and with `--out FILE` the schedule file that `verify`, `show`, `tune`
and `run --schedule FILE:Found` take. Exit 2 (one line) when no order fits the limit.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from schedcc.cli import args as shared
from schedcc.cli import memory_flags
from schedcc.cli.tune import (
    add_stage_costs,
    add_updates,
    costs_of,
    finer_line,
    guessed_line,
    ranking_table,
    updates_line,
    updates_of,
)
from schedcc.costs import measured_backward
from schedcc.errors import ScheduleConfigError
from schedcc.registry import get_schedule, registered_classes
from schedcc.search import METHODS, PLACEMENTS, SearchResult, placement_name, search
from schedcc.sizes import format_size
from schedcc.tune import tune

__all__ = ["register", "run"]

EPILOG = """examples:
  schedcc search -p 4 -m 8
  schedcc search -p 4 -m 8 --costs F=1,B=2,I=1,W=1,comm=0.1 --memory-limit 2 --recompute \
      --out my_order.py
  schedcc search -p 8 -m 32 --costs-from trace.json --time-limit 30
  schedcc search -p 2 -m 8 --costs-from trace.json --memory-limit 512KiB -v 1 --recompute
  schedcc search -p 4 -m 8 --costs O=0.5,L=0.5 --memory-limit 1 --offload
  schedcc search -p 4 -m 8 --costs F=1,B=2,comm=1 --method exact --time-limit 20
  schedcc search -p 4 -m 8 --costs F=1,B=2,comm=1 --memory-limit 2 --recompute --prove 30
  schedcc search -p 4 -m 8 -v 1,2,4 --costs F=1,B=2,comm=0.1 --eager
  schedcc search -p 4 -m 8 --segment-costs 'F=1.3,B=2.6;;;;;;;F=2.5,B=5' -v 1,2,4 --placement wave
  schedcc verify --schedule my_order.py:Found -p 4 -m 8 -v 2
"""

_BACKWARD = {"both": (False, True), "B": (False,), "IW": (True,)}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "search",
        help="find a faster order for your shape, costs and memory limit",
        description="Search compute orders (F/B or F/I/W per stage, recomputation or "
        "offloading where memory asks for it, looped or V placement) for the given costs and "
        "memory limit; print the best against every built-in, its lower bound and drawing; "
        "write it as a schedule file.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    shared.add_stages(parser, required=True)
    shared.add_microbatches(parser, default=8)
    shared.add_chunks(parser, default=[1, 2], many=True)
    parser.add_argument(
        "--placement",
        choices=(*PLACEMENTS, "wave", "both"),
        default="both",
        help="looped, v (the V at -v 2, a wave at more chunks; wave says the same) or both "
        "(default both)",
    )
    parser.add_argument(
        "--backward",
        choices=tuple(_BACKWARD),
        default=None,
        help="whole backwards (B), split into I and W (IW), or both (default: with --costs-from, "
        "the forms the trace measured; else both)",
    )
    memory_flags.add_memory(
        parser,
        limit=True,
        recompute_help="let the search recompute forwards where memory asks for it (and rank "
        "the built-ins with full recomputation too)",
    )
    parser.add_argument(
        "--offload",
        action="store_true",
        help="let the search offload activations to host memory where an order does not fit "
        "the limit (copies priced by --costs O=...,L=...; free by default)",
    )
    add_stage_costs(parser)
    shared.add_parallel(parser)
    add_updates(parser)
    shared.add_schedule(parser, many=True)
    parser.add_argument(
        "--time-limit",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds the search may take (default 10)",
    )
    parser.add_argument(
        "--method",
        choices=METHODS,
        default="auto",
        help="heuristic, exact (also CP-SAT on a relaxation of the simulator: a tighter bound "
        'and its optimum; pip install "schedcc[search]") or auto (exact for small shapes when '
        "ortools is installed; default)",
    )
    parser.add_argument(
        "--prove",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds more, after the search, to raise the lower bound by a time-indexed "
        "linear relaxation of each stage (proves more orders optimal; "
        'pip install "schedcc[search]"; default 0: none)',
    )
    shared.add_eager(parser, what="time and bound every order")
    parser.add_argument("--seed", type=int, default=0, help="seed of the ties' order")
    parser.add_argument(
        "--out", type=Path, default=None, metavar="FILE", help="write the found schedule here"
    )
    parser.add_argument(
        "--class-name", default="Found", metavar="NAME", help="its class (default Found)"
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    shared.check_size(args.num_stages, args.num_microbatches, max(args.num_chunks))
    memory = memory_flags.memory_of(args)
    if args.offload and args.memory_limit is None:
        raise ScheduleConfigError("--offload goes with --memory-limit (what the orders must fit)")
    if not args.class_name.isidentifier():
        raise ScheduleConfigError(f"--class-name must be a Python name, got {args.class_name!r}")
    if args.out is not None:  # before the search takes its time, not after
        shared.check_output_file("--out", args.out, example="found.py")
    costs = memory_flags.with_memory(costs_of(args), memory)
    extra = {name: get_schedule(name) for name in args.schedule}
    updates = updates_of(args)
    result = search(
        args.num_stages,
        args.num_microbatches,
        num_chunks=args.num_chunks,
        placement=PLACEMENTS if args.placement == "both" else args.placement,
        costs=costs,
        memory_limit=args.memory_limit,
        split_backward=_split_backward(args),
        recompute=args.recompute,
        offload=args.offload,
        data_parallel=args.dp,
        zero=args.zero,
        **updates,
        start=list(extra.values()),
        time_limit=args.time_limit,
        seed=args.seed,
        method=args.method,
        eager=args.eager,
        prove=args.prove,
    )
    cut = memory_flags.cut_line(memory, args.num_stages)
    if cut is not None:
        print(cut)
    print(_found_line(result))
    print(_bounds_line(result))
    found = type(result.schedule)
    ranking = tune(
        {**registered_classes(), **extra, "(found)": found},
        num_stages=args.num_stages,
        num_microbatches=args.num_microbatches,
        num_chunks=sorted({*args.num_chunks, found.shape[2]}),
        costs=costs,
        memory_limit=args.memory_limit,
        data_parallel=args.dp,
        zero=args.zero,
        **updates,
        recompute=(False, True) if args.recompute else False,
        eager=args.eager,
    )
    print(ranking_table(ranking))
    guessed = guessed_line(args.costs_from, args.costs)
    if guessed is not None and True in _split_backward(args):
        print(guessed)
    for line in (
        finer_line(costs, args.num_stages, (c.num_chunks for c in ranking.ranked)),
        updates_line(**updates),
    ):
        if line is not None:
            print(line)
    print(result.timeline.to_ascii())
    if args.out is not None:
        args.out.write_text(result.to_python(args.class_name))
        p, m, v = found.shape
        print(
            f"wrote {args.out} (class {args.class_name}): schedcc verify --schedule "
            f"{args.out}:{args.class_name} -p {p} -m {m} -v {v}"
        )
    return 0


def _split_backward(args) -> tuple[bool, ...]:
    """`--backward`, or by default the forms a `--costs-from` trace prices without optimism
    (`measured_backward`: F/B only after whole backwards), else both."""
    if args.backward is not None:
        return _BACKWARD[args.backward]
    if args.costs_from is not None:
        return measured_backward(args.costs_from)
    return _BACKWARD["both"]


def _bounds_line(result: SearchResult) -> str:
    """Each layout's lower bound, the least first; where that is of a layout in overlapped
    pairs, what no order without them beats."""
    line = "lower bound by layout: " + ", ".join(map(str, result.layout_bounds))
    if result.without_pairs is not None:
        line += f"; without overlapped pairs no order beats {result.without_pairs:g}"
    return line


def _found_line(result: SearchResult) -> str:
    schedule = type(result.schedule)
    p, m, v = schedule.shape
    kind = placement_name(schedule)
    held = (
        "peak bytes per stage [" + ", ".join(format_size(b) for b in result.peak_bytes) + "]"
        if result.peak_bytes is not None
        else "peak activations per stage ["
        + " ".join(f"{a:g}" for a in result.peak_activations)
        + "]"
    )
    timed = " (eager)" if result.eager else ""
    return (
        f"found: p={p} m={m} v={v} ({kind}), makespan{timed} {result.makespan:g}, lower bound "
        f"{result.bound:g} ({result.bound_from}; {result.gap:.1%} above it), {held}; from "
        f"{result.source}, {result.evaluations} orders timed in {result.seconds:.1f} s "
        f"({result.method} search)"
    )
