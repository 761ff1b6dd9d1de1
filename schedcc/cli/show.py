"""`schedcc show`: compile a schedule, simulate it and draw the timeline.

Prints the ASCII drawing (or writes a PNG, SVG or Chrome trace) and a summary line: makespan,
bubble and peak activations per stage.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from schedcc.cli import positive_int
from schedcc.compiler import compile
from schedcc.errors import ScheduleConfigError
from schedcc.registry import get_schedule
from schedcc.simulate import CostModel, simulate

__all__ = ["parse_costs", "register", "run"]

EPILOG = """examples:
  schedcc show --schedule 1f1b -p 4 -m 8
  schedcc show --schedule interleaved-1f1b -p 4 -m 8 -v 2 --costs F=1,B=2,comm=0.1
  schedcc show --schedule gpipe -p 4 -m 8 --format svg -o gpipe.svg
  schedcc show --schedule my_schedules.py:MySchedule -p 4 -m 8 --format chrome -o trace.json
"""

_COST_KEYS = {
    "F": "forward",
    "B": "backward",
    "I": "backward_input",
    "W": "backward_weight",
    "forward": "forward",
    "backward": "backward",
    "backward_input": "backward_input",
    "backward_weight": "backward_weight",
    "comm": "comm",
    "reduce": "reduce",
    "step": "step",
    "gather": "gather",
}
_SUFFIX = {"png": ".png", "svg": ".svg", "chrome": ".json", "ascii": ".txt"}
_FORMAT_OF = {".png": "png", ".svg": "svg", ".json": "chrome", ".txt": "ascii"}


def parse_costs(text: str) -> CostModel:
    """An argparse type: `F=1,B=2,I=1,W=1,comm=0.1` (also the long field names) to a CostModel."""
    fields: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        name = _COST_KEYS.get(key.strip())
        if not sep or name is None:
            raise argparse.ArgumentTypeError(
                f"bad cost {item!r}: expected KEY=NUMBER with KEY one of F, B, I, W, comm, "
                "reduce, step, gather (e.g. F=1,B=2,comm=0.1)"
            )
        try:
            fields[name] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bad cost {item!r}: {value!r} is not a number"
            ) from None
    try:
        return CostModel(**fields)
    except ScheduleConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_shape_arguments(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """--schedule, -p, -m, -v, --batches (shared with `schedcc verify`).

    `required=True` (show) requires --schedule and defaults the shape to p=4, m=8, one batch and
    the schedule's own number of chunks (v=1, or 2 for zb-v); `required=False` (verify) leaves
    them all None for the caller to fill.
    """
    parser.add_argument(
        "--schedule",
        required=required,
        metavar="NAME",
        help="a registered name (see `schedcc list`), module:Class or path/to/file.py:Class",
    )
    default = None if not required else 4
    parser.add_argument(
        "-p",
        "--num-stages",
        "--stages",  # as `schedcc run` spells it
        type=positive_int,
        default=default,
        metavar="P",
        help="pipeline stages",
    )
    default = None if not required else 8
    parser.add_argument(
        "-m",
        "--num-microbatches",
        "--microbatches",
        type=positive_int,
        default=default,
        metavar="M",
        help="microbatches per batch",
    )
    parser.add_argument(
        "-v",
        "--num-chunks",
        "--chunks",
        type=positive_int,
        default=None,
        metavar="V",
        help="chunks (virtual stages) per stage (default: the schedule's own, 1 for most)",
    )
    parser.add_argument(
        "--batches",
        type=positive_int,
        default=None if not required else 1,
        metavar="N",
        help="batches (optimizer steps) in one program",
    )


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "show",
        help="simulate a schedule and draw its timeline",
        description="Compile a schedule, simulate it under a cost model and draw the timeline.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_shape_arguments(parser, required=True)
    parser.add_argument(
        "--dp",
        type=positive_int,
        default=1,
        metavar="N",
        help="data-parallel replicas (adds gradient reductions)",
    )
    parser.add_argument("--zero", type=int, choices=(0, 1, 2), default=0, help="ZeRO stage")
    parser.add_argument(
        "--costs",
        type=parse_costs,
        default=CostModel(),
        metavar="K=V,...",
        help="instruction costs, e.g. F=1,B=2,I=1,W=1,comm=0.1,reduce=0.5",
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="time it with sends that never wait, as the distributed engine runs over gloo "
        "(default: every exchange a rendezvous, as the validator proves and NCCL needs)",
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
    """The schedule instance the shape arguments describe."""
    cls = get_schedule(args.schedule)
    chunks = {} if args.num_chunks is None else {"num_chunks": args.num_chunks}
    return cls(
        num_stages=args.num_stages,
        num_microbatches=args.num_microbatches,
        num_batches=args.batches,
        **chunks,
    )


def run(args) -> int:
    schedule = build(args)
    program = compile(schedule, data_parallel=args.dp, zero=args.zero)
    timeline = simulate(program, args.costs, eager=args.eager)
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
    return 0
