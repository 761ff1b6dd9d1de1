"""collect: run each stage's generator into a program, rejecting what is not an instruction."""

from __future__ import annotations

from schedcc.errors import ScheduleError
from schedcc.ir import Instruction
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
            where = f"{schedule!r}, stage {stage}, position {pos}"
            if not isinstance(op, Instruction) or type(op) in _BASES:
                raise ScheduleError(
                    f"{where}: yielded {op!r}, which is not a schedcc instruction "
                    "(Forward, Backward, BackwardInput, BackwardWeight, a comm or an update one)",
                    stage=stage,
                    position=pos,
                )
            microbatch = getattr(op, "microbatch", 0)
            if not _is_index(microbatch, num_microbatches):
                raise ScheduleError(
                    f"{where}: {op!r} has microbatch {microbatch!r}; it must be an int in "
                    f"[0, {num_microbatches}) (num_batches * num_microbatches)",
                    stage=stage,
                    position=pos,
                )
            chunk = getattr(op, "chunk", 0)
            if not _is_index(chunk, num_chunks):
                raise ScheduleError(
                    f"{where}: {op!r} has chunk {chunk!r}; it must be an int in [0, {num_chunks})",
                    stage=stage,
                    position=pos,
                )
        stages.append(ops)
    return Program(schedule, tuple(stages), data_parallel=data_parallel, zero=zero)


def _is_index(value: object, bound: int) -> bool:
    return type(value) is int and 0 <= value < bound


def _bases() -> tuple[type, ...]:
    from schedcc import ir

    return (ir.Instruction, ir.Compute, ir.Comm, ir.Update, ir._OnMicrobatch)


_BASES = _bases()
