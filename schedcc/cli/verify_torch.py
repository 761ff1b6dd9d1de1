"""`schedcc verify --torch CLASS`: run schedcc's checks on torch's own schedule description.

torch's built-in schedule `CLASS` (from `torch.distributed.pipelining.schedules`) is built with
stand-in stages and its per-rank `pipeline_order` is imported unchanged (see
`schedcc.interop.torch`). Printed: that order, which (segment, kind) rows do not cover
microbatches 0..m-1 exactly once, and the first error schedcc's compiler and validator find (or
the simulated bubble when it passes). Exit status 1 when a check fails.
"""

from __future__ import annotations

from collections import Counter

from schedcc.compiler import compile
from schedcc.errors import ScheduleError
from schedcc.interop.torch import TorchSchedule, format_actions, torch_schedule
from schedcc.simulate import simulate
from schedcc.validate import validate

__all__ = ["coverage_problems", "run_torch"]

_NAMES = {"F": "forwards", "B": "backwards", "I": "input-backwards", "W": "weight-backwards"}


def run_torch(args) -> int:
    """The `--torch` branch of `schedcc verify`; `args` has torch, num_stages, ... ."""
    p = args.num_stages or 4
    m = args.num_microbatches or 8
    schedule = torch_schedule(args.torch, p, m, num_chunks=args.num_chunks)
    print(f"{schedule!r}: torch's per-rank order (computes; torch stage index = segment)")
    print(format_actions(_rows(schedule)))
    problems = coverage_problems(schedule)
    error = _first_error(schedule)
    if not problems and error is None:
        timeline = simulate(compile(schedule))
        print(f"\npass: schedcc validates torch's order; {timeline.summary()}")
        return 0
    print("\nFAIL")
    for line in problems:
        print(f"  {line}")
    if error is not None:
        print(f"  {type(error).__name__}: {str(error).rstrip()}")
    return 1


def _rows(schedule: TorchSchedule) -> list[list[str]]:
    return [
        [f"{schedule.segment_of(s, op.chunk)}{op.code}{op.microbatch}" for op in schedule.steps(s)]
        for s in range(schedule.num_stages)
    ]


def coverage_problems(schedule: TorchSchedule) -> list[str]:
    """One line per (stage, segment, kind) whose microbatches are not 0..m-1, each once."""
    m = schedule.num_microbatches
    lines = []
    for stage in range(schedule.num_stages):
        seen: dict[tuple[int, str], Counter] = {}
        for op in schedule.steps(stage):
            segment = schedule.segment_of(stage, op.chunk)
            seen.setdefault((segment, op.code), Counter())[op.microbatch] += 1
        for (segment, code), counts in sorted(seen.items()):
            if sorted(counts.elements()) != list(range(m)):
                got = sorted(counts.elements())
                lines.append(
                    f"rank {stage}, segment {segment}: {_NAMES[code]} of microbatches "
                    f"{_span(got)}; expected 0..{m - 1}, each once"
                )
    return lines


def _span(values: list[int]) -> str:
    if values and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}..{values[-1]}"
    return ",".join(map(str, values))


def _first_error(schedule: TorchSchedule) -> ScheduleError | None:
    try:
        problems = validate(compile(schedule, validate=False), collect=True)
    except ScheduleError as exc:
        return exc
    return problems[0] if problems else None
