"""`compile`: a schedule in, a lowered and validated `Program` out."""

from __future__ import annotations

from schedcc._gc import paused_gc
from schedcc.errors import ScheduleConfigError
from schedcc.passes import PASSES, collect
from schedcc.program import Program
from schedcc.schedule import Schedule
from schedcc.validate import validate as _validate

__all__ = ["compile"]


def compile(
    schedule: Schedule,
    *,
    data_parallel: int = 1,
    zero: int = 0,
    validate: bool = True,
    max_activations: int | None = None,
) -> Program:
    """Compile `schedule` into per-stage programs: collect, insert comm, insert updates, versions.

    Args:
        schedule: a `Schedule` instance (shape given).
        data_parallel: pipeline replicas; above 1, gradients are reduced across them.
        zero: 0, 1 (ZeRO-1: reduce-scatter, sharded step, all-gather) or 2 (reduce-scatter
            after every backward).
        validate: run the validator on the result (raises its `ScheduleError`).
        max_activations: with `validate`, also bound the microbatch activations per stage.

    Raises:
        ScheduleConfigError: bad `data_parallel` or `zero`.
        ScheduleError: the schedule yields something invalid, or the program does not validate.

    >>> import schedcc
    >>> program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 2))
    >>> print(program.to_text())
    stage 0: F0 SA0 F1 SA1 RG1 B1 RG0 B0 Step
    stage 1: RA0 F0 RA1 F1 B1 SG1 B0 SG0 Step
    """
    if not isinstance(schedule, Schedule):
        raise ScheduleConfigError(
            f"compile() needs a Schedule instance, got {schedule!r}; e.g. "
            "compile(get_schedule('1f1b')(num_stages=4, num_microbatches=8))"
        )
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ScheduleConfigError(
            f"data_parallel must be a positive integer, got {data_parallel!r}"
        )
    if type(zero) is not int or zero not in (0, 1, 2):
        raise ScheduleConfigError(f"zero must be 0, 1 or 2, got {zero!r}")
    with paused_gc():
        program: Program = collect(schedule, data_parallel=data_parallel, zero=zero)
        for lower in PASSES:
            program = lower(program)
        if validate:
            _validate(program, max_activations=max_activations)
    return program
