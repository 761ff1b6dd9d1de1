"""collect: run each stage's generator into a program, rejecting what is not an instruction."""

from __future__ import annotations

from schedcc.errors import ScheduleError
from schedcc.ir import COMM, COMPUTE, UPDATE
from schedcc.program import Program
from schedcc.schedule import Schedule

__all__ = ["collect"]


def collect(schedule: Schedule, *, data_parallel: int = 1, zero: int = 0) -> Program:
    """The program whose stage s runs exactly what `schedule.steps(s)` yields.

    Raises:
        ScheduleError: something yielded is not an instruction, or its microbatch or chunk is
            out of range; the message names the stage and position.
    """
    num_microbatches = schedule.num_microbatches_total
    num_chunks = schedule.num_chunks
    stages = []
    for stage in range(schedule.num_stages):
        ops = tuple(schedule.steps(stage))
        for pos, op in enumerate(ops):
            if type(op) not in _CONCRETE:
                _reject(schedule, stage, pos, op)
            microbatch = getattr(op, "microbatch", 0)
            chunk = getattr(op, "chunk", 0)
            # _is_index, inlined: this loop sees every instruction of the program
            if not (
                type(microbatch) is int
                and 0 <= microbatch < num_microbatches
                and type(chunk) is int
                and 0 <= chunk < num_chunks
            ):
                _reject(schedule, stage, pos, op)
        stages.append(ops)
    return Program(schedule, tuple(stages), data_parallel=data_parallel, zero=zero)


def _reject(schedule: Schedule, stage: int, pos: int, op: object) -> None:
    """Raise the ScheduleError that says what is wrong with `op` (kept off the hot path)."""
    where = f"{schedule!r}, stage {stage}, position {pos}"
    if type(op) not in _CONCRETE:  # a non-instruction, a base class or a subclass
        raise ScheduleError(
            f"{where}: yielded {op!r}, which is not a schedcc instruction "
            "(Forward, Backward, BackwardInput, BackwardWeight, a comm or an update one)",
            stage=stage,
            position=pos,
        )
    microbatch = getattr(op, "microbatch", 0)
    if not _is_index(microbatch, schedule.num_microbatches_total):
        raise ScheduleError(
            f"{where}: {op!r} has microbatch {microbatch!r}; it must be an int in "
            f"[0, {schedule.num_microbatches_total}) (num_batches * num_microbatches)",
            stage=stage,
            position=pos,
        )
    chunk = getattr(op, "chunk", 0)
    raise ScheduleError(
        f"{where}: {op!r} has chunk {chunk!r}; it must be an int in [0, {schedule.num_chunks})",
        stage=stage,
        position=pos,
    )


def _is_index(value: object, bound: int) -> bool:
    return type(value) is int and 0 <= value < bound


_CONCRETE = frozenset((*COMPUTE, *COMM, *UPDATE))
