"""Check torch's own schedules with schedcc: coverage, the compiler's proof and a simulation.

`check_torch_schedule("Schedule1F1B", 4, 8)` builds torch's schedule with stand-in stages,
imports its per-rank `pipeline_order` unchanged (`schedcc.interop.torch.torch_schedule`), and
reports which (segment, kind) rows do not cover microbatches 0..m-1 exactly once, the first error
schedcc's compiler and validator find, and the simulated timeline when it passes. `schedcc verify
--torch CLASS` prints this report.

    >>> from schedcc.interop.torch_check import check_torch_schedule
    >>> report = check_torch_schedule("ScheduleGPipe", 2, 2)
    >>> report.ok, report.rows
    (True, (('0F0', '0F1', '0B0', '0B1'), ('1F0', '1F1', '1B0', '1B1')))
"""

from __future__ import annotations

from collections import Counter

import attrs

from schedcc.compiler import compile
from schedcc.errors import ScheduleError
from schedcc.interop.torch import TorchSchedule, torch_schedule
from schedcc.simulate import Timeline, simulate
from schedcc.validate import validate

__all__ = ["TorchCheck", "check_torch_schedule", "coverage_problems"]

_NAMES = {"F": "forwards", "B": "backwards", "I": "input-backwards", "W": "weight-backwards"}


@attrs.frozen
class TorchCheck:
    """What schedcc found in torch's schedule.

    Attributes:
        schedule: torch's order as a schedcc `TorchSchedule`.
        rows: its computes per rank in torch's text (`2F0`: segment 2, forward, microbatch 0).
        coverage: one line per (rank, segment, kind) whose microbatches are not 0..m-1 once.
        error: the first error schedcc's compiler or validator raises, or None.
        timeline: the simulation when the order validates, else None.
    """

    schedule: TorchSchedule
    rows: tuple[tuple[str, ...], ...]
    coverage: tuple[str, ...]
    error: ScheduleError | None
    timeline: Timeline | None

    @property
    def ok(self) -> bool:
        """Whether torch's order covers every microbatch and validates."""
        return not self.coverage and self.error is None


def check_torch_schedule(
    name: str, num_stages: int = 4, num_microbatches: int = 8, *, num_chunks: int | None = None
) -> TorchCheck:
    """Run schedcc's checks on torch's built-in schedule `name` at this shape (needs torch).

    Raises:
        ScheduleConfigError: an unknown or abstract class, or a shape torch rejects (see
            `torch_schedule`).
    """
    schedule = torch_schedule(name, num_stages, num_microbatches, num_chunks=num_chunks)
    coverage = tuple(coverage_problems(schedule))
    error = _first_error(schedule)
    timeline = None
    if not coverage and error is None:
        timeline = simulate(compile(schedule))
    return TorchCheck(schedule, _rows(schedule), coverage, error, timeline)


def _rows(schedule: TorchSchedule) -> tuple[tuple[str, ...], ...]:
    return tuple(
        tuple(
            f"{schedule.segment_of(s, op.chunk)}{op.code}{op.microbatch}"
            for op in schedule.order(s)
        )
        for s in range(schedule.num_stages)
    )


def coverage_problems(schedule: TorchSchedule) -> list[str]:
    """One line per (stage, segment, kind) whose microbatches are not 0..m-1, each once."""
    m = schedule.num_microbatches
    lines = []
    for stage in range(schedule.num_stages):
        seen: dict[tuple[int, str], Counter] = {}
        for op in schedule.order(stage):
            segment = schedule.segment_of(stage, op.chunk)
            seen.setdefault((segment, op.code), Counter())[op.microbatch] += 1
        for (segment, code), counts in sorted(seen.items()):
            got = sorted(counts.elements())
            if got != list(range(m)):
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
