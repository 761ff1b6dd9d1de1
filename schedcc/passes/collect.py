"""collect: run each stage's generator into a program, rejecting what is not an instruction."""

from __future__ import annotations

from itertools import islice

from schedcc.errors import ScheduleCodeError, ScheduleConfigError, call_user_code, describe
from schedcc.ir import COMM, COMPUTE, COPY, UPDATE
from schedcc.program import Program
from schedcc.schedule import Schedule

__all__ = ["collect", "max_instructions"]

#: [Note: the collect limit] A valid program has at most ~10 instructions per (microbatch,
#: chunk) on a stage (F, I, W, R, four comm ops, a ZeRO-2 reduce) plus a few updates per
#: (batch, chunk); a generator that yields more than this many is taken not to end.
INSTRUCTIONS_PER_MICROBATCH_CHUNK = 64
INSTRUCTIONS_SLACK = 1024


def max_instructions(schedule: Schedule) -> int:
    """The most instructions `collect` takes from one stage of `schedule` (see the Note)."""
    shape = schedule.num_microbatches_total * schedule.num_chunks
    return INSTRUCTIONS_PER_MICROBATCH_CHUNK * shape + INSTRUCTIONS_SLACK


def collect(schedule: Schedule, *, data_parallel: int = 1, zero: int = 0) -> Program:
    """The program whose stage s runs exactly what `schedule.order(s)` yields.

    Raises:
        ScheduleConfigError: `schedule.num_chunks` is not one of its class's `chunks`.
        ScheduleCodeError: `order()` raised, returned something that is not iterable, yielded
            something that is not an instruction, or a microbatch or chunk out of range, or
            more than `max_instructions(schedule)` instructions; the message names the class,
            the stage and the position.
    """
    num_microbatches = schedule.num_microbatches_total
    num_chunks = schedule.num_chunks
    if not type(schedule).supports_chunks(num_chunks):  # the constructor refuses it first
        raise ScheduleConfigError(
            f"{describe(schedule)}: num_chunks={num_chunks} is not one of "
            f"{type(schedule).__name__}.chunks = {type(schedule).chunks!r}"
        )
    stages = []
    for stage in range(schedule.num_stages):
        ops = _stage_ops(schedule, stage)
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


def _stage_ops(schedule: Schedule, stage: int) -> tuple:
    """What `schedule.order(stage)` yields, up to the limit; a failure names the method."""
    owner, method, where = type(schedule).__name__, f"order({stage})", describe(schedule)
    if type(schedule).order is Schedule.order:
        raise ScheduleCodeError(
            f"{owner} does not define order(stage): a schedule yields each stage's instructions "
            "from it (see schedcc.Schedule)",
            stage=stage,
        )
    returned = call_user_code(owner, method, lambda: schedule.order(stage), where=where)
    try:
        iterator = iter(returned)
    except TypeError:
        raise ScheduleCodeError(
            f"{where}: {owner}.{method} returned {returned!r}, which is not iterable; write "
            "order() as a generator that yields instructions",
            stage=stage,
        ) from None
    limit = max_instructions(schedule)
    ops = call_user_code(owner, method, lambda: tuple(islice(iterator, limit + 1)), where=where)
    if len(ops) > limit:
        raise ScheduleCodeError(
            f"{where}: {owner}.{method} yielded more than {limit} instructions for stage "
            f"{stage}, the limit for this shape ({INSTRUCTIONS_PER_MICROBATCH_CHUNK} per "
            f"microbatch and chunk, plus {INSTRUCTIONS_SLACK}); does its generator end?",
            stage=stage,
        )
    return ops


def _reject(schedule: Schedule, stage: int, pos: int, op: object) -> None:
    """Raise the error that says what is wrong with `op` (kept off the hot path)."""
    where = f"{describe(schedule)}, stage {stage}, position {pos}"
    method = f"{type(schedule).__name__}.order({stage})"
    if type(op) not in _CONCRETE:  # a non-instruction, a base class or a subclass
        raise ScheduleCodeError(
            f"{where}: {method} yielded {op!r}, which is not a schedcc instruction "
            "(Forward, Backward, BackwardInput, BackwardWeight, a comm or an update one)",
            stage=stage,
            position=pos,
        )
    microbatch = getattr(op, "microbatch", 0)
    if not _is_index(microbatch, schedule.num_microbatches_total):
        raise ScheduleCodeError(
            f"{where}: {method} yielded {op!r}, with microbatch {microbatch!r}; it must be an int "
            f"in [0, {schedule.num_microbatches_total}) (num_batches * num_microbatches)",
            stage=stage,
            position=pos,
        )
    chunk = getattr(op, "chunk", 0)
    raise ScheduleCodeError(
        f"{where}: {method} yielded {op!r}, with chunk {chunk!r}; it must be an int in "
        f"[0, {schedule.num_chunks}) (num_chunks, one of the class's chunks = "
        f"{type(schedule).chunks!r})",
        stage=stage,
        position=pos,
    )


def _is_index(value: object, bound: int) -> bool:
    return type(value) is int and 0 <= value < bound


_CONCRETE = frozenset((*COMPUTE, *COMM, *COPY, *UPDATE))
