"""`schedcc verify`: compile and validate a schedule over a grid of shapes, and report.

Each shape (p, m, v, batches) the schedule accepts is compiled and validated; the table shows
pass or the failing rule, and the validator's explanation follows for each failure. Shapes the
schedule itself rejects (its `check()` raises `ScheduleConfigError`) are skipped. Exit status 1
when any shape fails, 0 when all pass, 2 for bad input.
"""

from __future__ import annotations

import argparse
import itertools

import attrs

from schedcc.cli.show import add_shape_arguments
from schedcc.compiler import compile
from schedcc.errors import ScheduleConfigError
from schedcc.registry import get_schedule
from schedcc.simulate import simulate
from schedcc.validate import validate

__all__ = ["GRID", "register", "run"]

#: The default values of each shape argument; a given argument replaces its row.
GRID = {
    "num_stages": (1, 2, 3, 4, 8),
    "num_microbatches": (1, 2, 3, 4, 8, 16),
    "num_chunks": (1, 2),
    "num_batches": (1, 2),
}
_MAX_EXPLAINED = 5

EPILOG = """examples:
  schedcc verify --schedule 1f1b
  schedcc verify --schedule interleaved-1f1b -p 4 -v 2
  schedcc verify --schedule my_schedules.py:MySchedule -p 4 -m 8
  schedcc verify --schedule my_package.schedules:MySchedule --batches 3
  schedcc verify --torch Schedule1F1B -p 4 -m 8
"""


@attrs.frozen
class _Result:
    shape: tuple[int, int, int, int]
    error: BaseException | None = None
    skipped: str | None = None
    summary: str = ""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="validate a schedule over a grid of shapes",
        description=(
            "Compile and validate a schedule for every shape of a grid (p in 1,2,3,4,8; m in "
            "1,2,3,4,8,16; v in 1,2; batches in 1,2), or only the values given, and print a "
            "pass/fail table with the validator's explanation of each failure."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_shape_arguments(parser, required=False)
    parser.add_argument(
        "--torch",
        metavar="CLASS",
        default=None,
        help="instead of --schedule: check torch.distributed.pipelining's own schedule CLASS "
        "(e.g. Schedule1F1B; -p and -m default to 4 and 8)",
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    if args.torch is not None and args.schedule is not None:
        raise ScheduleConfigError("give --schedule or --torch, not both")
    if args.torch is not None:
        from schedcc.cli.verify_torch import run_torch

        return run_torch(args)
    if args.schedule is None:
        raise ScheduleConfigError("give --schedule NAME (or --torch CLASS for a torch schedule)")
    cls = get_schedule(args.schedule)
    given = {
        "num_stages": args.num_stages,
        "num_microbatches": args.num_microbatches,
        "num_chunks": args.num_chunks,
        "num_batches": args.batches,
    }
    axes = [(value,) if value is not None else GRID[key] for key, value in given.items()]
    results = [_check(cls, shape) for shape in itertools.product(*axes)]
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


def _check(cls, shape) -> _Result:
    p, m, v, b = shape
    try:
        schedule = cls(num_stages=p, num_microbatches=m, num_chunks=v, num_batches=b)
    except ScheduleConfigError as exc:
        return _Result(shape, skipped=str(exc))
    try:
        program = compile(schedule, validate=False)
        problems = validate(program, collect=True)
        if problems:
            return _Result(shape, error=problems[0])
        timeline = simulate(program)
    except Exception as exc:  # a ScheduleError, or a user's steps() failing in any other way
        return _Result(shape, error=exc)
    peaks = ",".join(str(n) for n in timeline.peak_activations)
    summary = f"{timeline.bubble_fraction:6.1%}  [{peaks}]"
    return _Result(shape, summary=summary)


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
