"""`schedcc verify`: compile and validate a schedule over a grid of shapes, and report.

Each shape (p, m, v, batches) the schedule accepts is compiled and validated; the table shows
pass or the failing rule, and the validator's explanation follows for each failure. Shapes the
schedule itself rejects (its `check()` raises `ScheduleConfigError`) are skipped; the chunk
counts v are the first two of the schedule's own `chunks` unless `-v` gives one. `--recompute`
checks the programs that `compile(..., recompute=True)` makes (an `R` before each backward).
Exit status 1 when any shape fails, 0 when all pass, 2 for bad input, including a schedule whose
own code fails (`ScheduleCodeError`). `--torch CLASS` checks torch's own schedule instead
(`schedcc.interop.torch_check`).
"""

from __future__ import annotations

import argparse
import itertools

import attrs

from schedcc.cli import args as shared
from schedcc.compiler import compile
from schedcc.errors import ScheduleConfigError, ScheduleError
from schedcc.registry import build_schedule, get_schedule
from schedcc.schedule import ScheduleCodeError
from schedcc.simulate import simulate
from schedcc.validate import validate

__all__ = ["GRID", "register", "run"]

#: The default values of each shape argument; a given argument replaces its row. The chunk
#: counts are the schedule's own: the first two of its `chunks`.
GRID = {
    "num_stages": (1, 2, 3, 4, 8),
    "num_microbatches": (1, 2, 3, 4, 8, 16),
    "num_batches": (1, 2),
}
_MAX_EXPLAINED = 5

EPILOG = """examples:
  schedcc verify --schedule 1f1b
  schedcc verify --schedule interleaved-1f1b -p 4 -v 2
  schedcc verify --schedule my_schedules.py:MySchedule -p 4 -m 8
  schedcc verify --schedule my_package.schedules:MySchedule --batches 3 --dp 2 --zero 1
  schedcc verify --schedule zb-h1 --recompute --dp 2 --zero 3
  schedcc verify --torch Schedule1F1B -p 4 -m 8
"""


@attrs.frozen
class _Result:
    shape: tuple[int, int, int, int]
    error: ScheduleError | None = None
    skipped: str | None = None
    summary: str = ""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="validate a schedule over a grid of shapes",
        description=(
            "Compile and validate a schedule for every shape of a grid (p in 1,2,3,4,8; m in "
            "1,2,3,4,8,16; v the first two of the schedule's chunks; batches in 1,2), or only "
            "the values given, and print a pass/fail table with the validator's explanation of "
            "each failure."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    shared.add_schedule(parser)
    shared.add_stages(parser)
    shared.add_microbatches(parser)
    shared.add_chunks(parser)
    shared.add_batches(parser)
    shared.add_parallel(parser)
    parser.add_argument(
        "--recompute",
        action="store_true",
        help="check the programs that recompute every forward before its backward "
        "(compile(..., recompute=True))",
    )
    parser.add_argument(
        "--torch",
        metavar="CLASS",
        default=None,
        help="instead of --schedule: check torch.distributed.pipelining's own schedule CLASS "
        "(e.g. Schedule1F1B; -p and -m default to 4 and 8)",
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    if args.torch is not None:
        return _run_torch(args)
    if args.schedule is None:
        raise ScheduleConfigError("give --schedule NAME (or --torch CLASS for a torch schedule)")
    cls = get_schedule(args.schedule)
    axes = _axes(cls, args)
    shared.check_size(*(max(axis) for axis in axes))
    results = [_check(cls, shape, args) for shape in itertools.product(*axes)]
    checked = [r for r in results if r.skipped is None]
    if not checked:
        reasons = sorted({r.skipped for r in results if r.skipped})
        raise ScheduleConfigError(
            f"{cls.__name__} accepts none of the shapes asked for: {reasons[0]}"
        )
    print(_table(cls, checked))
    failed = [r for r in checked if r.error is not None]
    skipped = len(results) - len(checked)
    print(
        f"\n{len(checked) - len(failed)} of {len(checked)} shapes pass"
        + (f" ({skipped} skipped: the schedule rejects them)" if skipped else "")
    )
    for result in failed[:_MAX_EXPLAINED]:
        p, m, v, b = result.shape
        print(f"\n--- p={p} m={m} v={v} batches={b}: {type(result.error).__name__}")
        print(str(result.error).rstrip())
    if len(failed) > _MAX_EXPLAINED:
        print(f"\n... and {len(failed) - _MAX_EXPLAINED} more failing shapes")
    return 1 if failed else 0


def _axes(cls, args) -> list[tuple[int, ...]]:
    """The values of p, m, v and batches to try: each given one, else the grid's (v: the first
    two of the schedule's `chunks`)."""
    chunks = cls.chunk_counts(shared.MAX_CHUNKS, first=2)
    if args.num_chunks is None and not chunks:
        raise ScheduleConfigError(
            f"{cls.__name__} runs no chunk count up to {shared.MAX_CHUNKS} (its chunks = "
            f"{cls.chunks!r}); give one with -v"
        )
    return [
        (args.num_stages,) if args.num_stages is not None else GRID["num_stages"],
        (args.num_microbatches,) if args.num_microbatches is not None else GRID["num_microbatches"],
        (args.num_chunks,) if args.num_chunks is not None else chunks,
        (args.batches,) if args.batches is not None else GRID["num_batches"],
    ]


def _check(cls, shape, args) -> _Result:
    """Build, compile, validate and simulate one shape; the schedule's own failures raise."""
    p, m, v, b = shape
    try:
        schedule = build_schedule(cls, p, m, num_chunks=v, num_batches=b)
    except ScheduleConfigError as exc:
        return _Result(shape, skipped=str(exc))
    try:
        program = compile(
            schedule,
            data_parallel=args.dp,
            zero=args.zero,
            recompute=args.recompute,
            validate=False,
        )
        problems = validate(program, collect=True)
        if problems:
            return _Result(shape, error=problems[0])
        timeline = simulate(program)
    except ScheduleCodeError:
        raise
    except ScheduleError as exc:
        return _Result(shape, error=exc)
    peaks = ",".join(str(n) for n in timeline.peak_activations)
    return _Result(shape, summary=f"{timeline.bubble_fraction:6.1%}  [{peaks}]")


def _table(cls, results: list[_Result]) -> str:
    header = ("p", "m", "v", "batches", "result", "bubble  peak activations")
    rows = []
    for r in results:
        status = "pass" if r.error is None else f"FAIL {type(r.error).__name__}"
        rows.append((*map(str, r.shape), status, r.summary))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [f"{cls.name or cls.__name__}: {len(results)} shapes"]
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def _run_torch(args) -> int:
    """`--torch CLASS`: print torch's order and what schedcc's checks find in it."""
    from schedcc.interop.torch import format_actions
    from schedcc.interop.torch_check import check_torch_schedule

    if args.schedule is not None:
        raise ScheduleConfigError("give --schedule or --torch, not both")
    if args.batches not in (None, 1) or args.dp != 1 or args.zero != 0 or args.recompute:
        raise ScheduleConfigError(
            "--torch checks one batch of one pipeline as torch runs it: drop --batches, --dp, "
            "--zero and --recompute"
        )
    report = check_torch_schedule(
        args.torch, args.num_stages or 4, args.num_microbatches or 8, num_chunks=args.num_chunks
    )
    print(f"{report.schedule!r}: torch's per-rank order (computes; torch stage index = segment)")
    print(format_actions(report.rows))
    if report.ok:
        print(f"\npass: schedcc validates torch's order; {report.timeline.summary()}")
        return 0
    print("\nFAIL")
    for line in report.coverage:
        print(f"  {line}")
    if report.error is not None:
        print(f"  {type(report.error).__name__}: {str(report.error).rstrip()}")
    return 1
