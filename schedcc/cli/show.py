"""`schedcc show`: compile a schedule, simulate it and draw the timeline.

Prints the ASCII drawing (or writes a PNG, SVG or Chrome trace) and a summary line: makespan,
bubble and peak activations per stage.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from schedcc.cli import args as shared
from schedcc.cli import memory_flags
from schedcc.cli.args import UsageError
from schedcc.compiler import compile
from schedcc.costs import CostModel
from schedcc.errors import ScheduleConfigError
from schedcc.registry import build_schedule, get_schedule
from schedcc.simulate import simulate

__all__ = ["register", "run"]

EPILOG = """examples:
  schedcc show --schedule 1f1b -p 4 -m 8
  schedcc show --schedule interleaved-1f1b -p 4 -m 8 -v 2 --costs F=1,B=2,comm=0.1
  schedcc show --schedule zb-v -p 2 -m 4 -v 2 --segment-costs ';;;F=2.5,I=2.5,W=2.5'
  schedcc show --schedule gpipe -p 4 -m 8 --format svg -o gpipe.svg
  schedcc show --schedule 1f1b -p 4 -m 8 --forward-only
  schedcc show --schedule 1f1b -p 4 -m 8 --recompute --memory activations=64MiB,params=1GiB
  schedcc show --schedule my_schedules.py:MySchedule -p 4 -m 8 --format chrome -o trace.json
"""

_SUFFIX = {"png": ".png", "svg": ".svg", "chrome": ".json", "ascii": ".txt"}
_FORMAT_OF = {".png": "png", ".svg": "svg", ".json": "chrome", ".txt": "ascii"}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "show",
        help="simulate a schedule and draw its timeline",
        description="Compile a schedule, simulate it under a cost model and draw the timeline.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    shared.add_schedule(parser, required=True)
    shared.add_stages(parser, found=4)
    shared.add_microbatches(parser, found=8)
    shared.add_chunks(parser)
    shared.add_batches(parser, default=1)
    shared.add_parts(parser)
    shared.add_parallel(parser)
    shared.add_costs(
        parser, default=CostModel(), help="instruction costs, e.g. F=1,B=2,I=1,W=1,comm=0.1"
    )
    shared.add_segment_costs(parser)
    shared.add_eager(parser)
    parser.add_argument(
        "--forward-only",
        action="store_true",
        help="draw the forward-only program evaluation runs (compile(..., forward_only=True))",
    )
    memory_flags.add_memory(
        parser,
        recompute_help="recompute every forward before its backward (compile(..., recompute=True))",
    )
    parser.add_argument(
        "--offload",
        action="store_true",
        help="offload every forward's activations to host memory that has a compute to overlap "
        "(compile(..., offload=True)); price the copies with --costs O=...,L=...",
    )
    parser.add_argument(
        "--format",
        choices=("ascii", "png", "svg", "chrome"),
        default=None,
        help="drawing format (default: from -o's suffix, else ascii)",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the drawing here (default: print ascii; files get a name from the schedule)",
    )
    parser.set_defaults(func=run)


def build(args):
    """The schedule instance the shape arguments describe (size-checked)."""
    shared.fill_shape(args, args.schedule)
    schedule = build_schedule(
        get_schedule(args.schedule),
        args.num_stages,
        args.num_microbatches,
        num_chunks=args.num_chunks,
        num_batches=args.batches,
        num_parts=args.parts,
    )
    shared.check_size(
        schedule.num_stages,
        schedule.num_microbatches,
        schedule.num_chunks,
        schedule.num_batches,
    )
    return schedule


def _with_segments(args, schedule) -> CostModel:
    """`--costs` with `--segment-costs` each segment's own ([Note: segment costs]): as many as
    one model replica's segments, or a multiple of them (summed per segment)."""
    if args.segment_costs is None:
        return args.costs
    cut = schedule.num_segments // type(schedule).num_replicas
    if len(args.segment_costs) % cut:
        raise UsageError(
            f"--segment-costs gives {len(args.segment_costs)} segments, but this program cuts "
            f"the model in {cut}: give {cut} (or a multiple, summed per segment)"
        )
    return shared.with_segments(args.costs, args.segment_costs, schedule.num_stages)


def run(args) -> int:
    schedule = build(args)
    program = compile(
        schedule,
        data_parallel=args.dp,
        zero=args.zero,
        forward_only=args.forward_only,
        recompute=args.recompute,
        offload=args.offload,
    )
    costs = memory_flags.with_memory(_with_segments(args, schedule), args.memory)
    timeline = simulate(program, costs, eager=args.eager)
    if not math.isfinite(timeline.makespan):
        raise ScheduleConfigError(
            f"--costs: the simulated makespan overflows ({timeline.makespan}); give the costs "
            "in a larger unit (smaller numbers)"
        )
    fmt = args.format or (_FORMAT_OF.get(args.output.suffix.lower()) if args.output else "ascii")
    if fmt is None:
        raise ScheduleConfigError(
            f"cannot tell the format of {str(args.output)!r}: give --format, or a .png, .svg, "
            ".json or .txt file"
        )
    output = args.output
    if output is None and fmt != "ascii":
        name = (schedule.name or type(schedule).__name__).replace("/", "-")
        output = Path(f"{name}-p{schedule.num_stages}-m{schedule.num_microbatches}{_SUFFIX[fmt]}")
    if fmt == "ascii":
        text = timeline.to_ascii(color=None if output is None else False)
        if output is None:
            print(text)
        else:
            output.write_text(text + "\n")
    elif fmt == "chrome":
        timeline.to_chrome_trace(output)
    else:
        if output.suffix.lower() != _SUFFIX[fmt]:
            raise ScheduleConfigError(
                f"--format {fmt} writes a {_SUFFIX[fmt]} file, but -o is {str(output)!r}"
            )
        timeline.save(output)
    if output is not None:
        print(f"wrote {output}")
    print(timeline.summary())
    if args.memory is not None:
        print(memory_flags.bytes_line(timeline.peak_bytes))
        if any(timeline.peak_host_bytes):
            print("on the host: " + memory_flags.bytes_line(timeline.peak_host_bytes))
    return 0
