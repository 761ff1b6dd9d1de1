"""The `Schedule` base class a pipeline schedule is written against.

A schedule says, for each stage, the order of its compute instructions; the compiler derives the
communication, the data-parallel updates and the weight versions. docs/schedules.md is the guide
to writing one; docs/design.md says what the compiler does with it.

    >>> from schedcc import Schedule, Forward, Backward
    >>> class GPipe(Schedule):
    ...     name = "my-gpipe"
    ...     def steps(self, stage):
    ...         for b in range(self.num_batches):
    ...             yield from (Forward(i) for i in self.microbatches(b))
    ...             yield from (Backward(i) for i in reversed(self.microbatches(b)))
    >>> GPipe(num_stages=2, num_microbatches=4).microbatches(0)
    range(0, 4)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar, TypeVar

from schedcc.errors import (
    ScheduleCodeError,
    ScheduleConfigError,
    ScheduleError,
    UserCodeError,
    call_user,
)
from schedcc.ir import Instruction

__all__ = [
    "Schedule",
    "ScheduleCodeError",
    "VShape",
    "build_schedule",
    "call_user_code",
    "chunks_hint",
    "describe",
    "uses_chunks",
]

_T = TypeVar("_T")


def describe(schedule: Schedule) -> str:
    """`repr(schedule)`, or the base class's form if the schedule's own `__repr__` fails."""
    try:
        return call_user("__repr__()", lambda: repr(schedule))
    except UserCodeError:
        return Schedule.__repr__(schedule)


def call_user_code(
    owner: str, method: str, call: Callable[[], _T], *, where: str = "", hint: str = ""
) -> _T:
    """`call()` through the user-code guard (`schedcc.errors.call_user`): anything it raises but
    a schedcc error or `KeyboardInterrupt`, `SystemExit` included, is a `ScheduleCodeError` that
    names `owner.method` (one line: `where`, the original message's first line, `hint`)."""
    return call_user(f"{owner}.{method}", call, error=ScheduleCodeError, where=where, hint=hint)


class Schedule:
    """Base class of every schedule: subclass it and write `steps(stage)`.

    Args:
        num_stages: pipeline ranks `p`, at least 1.
        num_microbatches: microbatches per optimizer step `m`, at least 1.
        num_chunks: segments per stage `v` ("virtual stages"), at least 1; None (the default)
            takes the class's `default_num_chunks`.
        num_batches: optimizer steps covered by one program `B`, at least 1.

    Raises:
        ScheduleConfigError: an argument breaks a rule; the message names it.
    """

    name: ClassVar[str] = ""
    #: The forward of batch b uses weight version max(0, b - weight_delay).
    weight_delay: ClassVar[int] = 0
    #: How many replicas of the model the segments hold (see [Note: replicas]): replica r is
    #: segments `r*L .. (r+1)*L - 1` with `L = p*v / num_replicas`, segment `r*L + j` a copy of
    #: segment j, and each microbatch runs only the replica `replica_of` gives it.
    num_replicas: ClassVar[int] = 1
    #: The chunks per stage a schedule gets when `num_chunks` is not given.
    default_num_chunks: ClassVar[int] = 1

    def __init__(
        self,
        num_stages: int,
        num_microbatches: int,
        num_chunks: int | None = None,
        num_batches: int = 1,
    ) -> None:
        if num_chunks is None:
            num_chunks = type(self).default_num_chunks
        for arg, value in [
            ("num_stages", num_stages),
            ("num_microbatches", num_microbatches),
            ("num_chunks", num_chunks),
            ("num_batches", num_batches),
        ]:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScheduleConfigError(
                    f"{type(self).__name__}: {arg} must be a positive integer, got {value!r}"
                )
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.num_chunks = num_chunks
        self.num_batches = num_batches
        owner = type(self).__name__
        call_user_code(owner, "check()", self.check, where=Schedule.__repr__(self))
        delay = type(self).weight_delay
        if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
            raise ScheduleConfigError(
                f"{owner}.weight_delay must be an integer >= 0, got {delay!r}"
            )
        replicas = type(self).num_replicas
        if (
            isinstance(replicas, bool)
            or not isinstance(replicas, int)
            or replicas < 1
            or self.num_segments % replicas
        ):
            raise ScheduleConfigError(
                f"{owner}.num_replicas must be a positive integer dividing the p*v = "
                f"{self.num_segments} segments, got {replicas!r}"
            )
        self._segments = self._segment_table()

    # -- for subclasses -------------------------------------------------------------------------

    def steps(self, stage: int) -> Iterable[Instruction]:
        """Yield stage `stage`'s instructions in the order it runs them."""
        raise NotImplementedError(f"{type(self).__name__} must define steps(stage)")

    def check(self) -> None:
        """Raise `ScheduleConfigError` if this shape breaks one of the schedule's own rules."""

    def placement(self, segment: int) -> tuple[int, int]:
        """The `(stage, chunk)` that holds `segment`; looped (Megatron interleaving) by default."""
        return segment % self.num_stages, segment // self.num_stages

    def replica_of(self, microbatch: int) -> int:
        """The model replica microbatch `microbatch` (its index within its batch, < m) runs,
        in `range(num_replicas)`; 0 by default (see [Note: replicas])."""
        return 0

    # -- derived --------------------------------------------------------------------------------

    @classmethod
    def description(cls) -> str:
        """The first line of the class docstring."""
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""

    @property
    def num_segments(self) -> int:
        """`p * v`, the number of model segments."""
        return self.num_stages * self.num_chunks

    @property
    def num_microbatches_total(self) -> int:
        """`B * m`, the microbatches of the whole program."""
        return self.num_batches * self.num_microbatches

    def microbatches(self, batch: int) -> range:
        """The global microbatch indices of `batch`: `range(b * m, (b + 1) * m)`."""
        m = self.num_microbatches
        return range(batch * m, (batch + 1) * m)

    def batch_of(self, microbatch: int) -> int:
        """The batch a global microbatch index belongs to."""
        return microbatch // self.num_microbatches

    def segment_of(self, stage: int, chunk: int) -> int:
        """The segment that `stage` holds as its chunk `chunk`."""
        return self._segments[stage][chunk]

    def segment_table(self) -> list[list[int]]:
        """`table[stage][chunk]` is the segment there (a copy)."""
        return [list(row) for row in self._segments]

    def _segment_table(self) -> tuple[tuple[int, ...], ...]:
        p, v = self.num_stages, self.num_chunks
        table: list[list[int | None]] = [[None] * v for _ in range(p)]
        for segment in range(p * v):
            placed = call_user_code(
                type(self).__name__, f"placement({segment})", lambda k=segment: self.placement(k)
            )
            if not _is_place(placed, p, v) or table[placed[0]][placed[1]] is not None:
                raise ScheduleConfigError(
                    f"{type(self).__name__}.placement({segment}) = {placed} is out of range or "
                    f"taken: placement must map the {p * v} segments one-to-one onto "
                    f"(stage < {p}, chunk < {v})"
                )
            table[placed[0]][placed[1]] = segment
        return tuple(tuple(row) for row in table)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        shape = f"p={self.num_stages}, m={self.num_microbatches}"
        if self.num_chunks > 1:
            shape += f", v={self.num_chunks}"
        if self.num_batches > 1:
            shape += f", batches={self.num_batches}"
        return f"{type(self).__name__}({shape})"


def _is_place(placed: object, num_stages: int, num_chunks: int) -> bool:
    """Whether `placed` is a `(stage, chunk)` pair of ints in range."""
    if not isinstance(placed, (tuple, list)) or len(placed) != 2:
        return False
    bounds = (num_stages, num_chunks)
    return all(
        isinstance(index, int) and not isinstance(index, bool) and 0 <= index < bound
        for index, bound in zip(placed, bounds)
    )


class VShape(Schedule):
    """Base of the schedules that hold two chunks per stage in a V (zb-v, dualpipe-v, v-half,
    v-min, dualpipe): segment k < p on stage k as chunk 0, segment k >= p on stage 2p - 1 - k as
    chunk 1, down the stages and back up. `num_chunks` defaults to 2 and `check()` refuses any
    other; a subclass's own `check()` calls this one first.

    >>> class Mine(VShape):
    ...     def steps(self, stage):
    ...         yield from ()
    >>> [Mine(2, 1).placement(k) for k in range(4)]
    [(0, 0), (1, 0), (1, 1), (0, 1)]
    """

    #: How `check()` names the two chunks a stage holds.
    two_chunks: ClassVar[str] = "places exactly two chunks per stage (a V)"
    default_num_chunks = 2

    def check(self) -> None:
        if self.num_chunks != 2:
            raise ScheduleConfigError(
                f"{self.name} {self.two_chunks}, got num_chunks={self.num_chunks}; pass "
                "num_chunks=2 (-v 2)"
            )

    def placement(self, segment: int) -> tuple[int, int]:
        """Segment k < p on (k, 0), segment k >= p on (2p - 1 - k, 1): down and back up."""
        p = self.num_stages
        return (segment, 0) if segment < p else (2 * p - 1 - segment, 1)


def build_schedule(
    schedule_cls: type[Schedule],
    num_stages: int,
    num_microbatches: int,
    *,
    num_chunks: int | None = None,
    num_batches: int = 1,
) -> Schedule:
    """`schedule_cls` at this shape, where a failure of the class's own code is a typed error.

    `num_chunks=None` keeps the class's own `default_num_chunks` (1, or 2 for ZB-V). Used
    wherever a class a user named is built (the CLI, `schedcc.tune`, `schedcc.testing`).

    Raises:
        ScheduleConfigError: the schedule rejects the shape (its `check()` says why).
        ScheduleCodeError: the constructor does not take the standard arguments, or raised
            something else; the message names the class.

    >>> from schedcc.registry import get_schedule
    >>> build_schedule(get_schedule("zb-v"), 4, 8)
    ZBV(p=4, m=8, v=2)
    """
    kwargs = {"num_stages": num_stages, "num_microbatches": num_microbatches}
    if num_chunks is not None:
        kwargs["num_chunks"] = num_chunks
    kwargs["num_batches"] = num_batches
    name = getattr(schedule_cls, "__name__", repr(schedule_cls))
    shape = ", ".join(f"{key}={value}" for key, value in kwargs.items())
    schedule = call_user_code(
        name,
        "__init__()",
        lambda: schedule_cls(**kwargs),
        where=f"{name}({shape})",
        hint="a schedule's constructor takes (num_stages, num_microbatches, num_chunks=1, "
        "num_batches=1), as schedcc.Schedule's does",
    )
    if not isinstance(schedule, Schedule):
        raise ScheduleCodeError(f"{name}(...) made {schedule!r}, not a schedcc.Schedule")
    return schedule


#: Shapes (p, m) at which `uses_chunks` probes a schedule with two chunks per stage.
_PROBE_SHAPES = ((2, 4), (1, 2), (4, 8), (2, 2), (4, 4), (8, 16))


def uses_chunks(schedule_cls: type[Schedule]) -> bool:
    """Whether `schedule_cls` uses a second chunk when it is given two per stage.

    False when its constructor rejects `num_chunks=2` at every probed shape, and when it accepts
    it but yields nothing on chunk 1 (a schedule written for one chunk per stage, like the
    README's GPipe); the shape grids of `schedcc verify` and `schedcc.testing` then keep v = 1.
    True otherwise, including when the probe fails (the grid will report why). A class may add
    `(p, m)` shapes to probe first in a `probe_shapes` attribute.

    >>> from schedcc.registry import get_schedule
    >>> uses_chunks(get_schedule("interleaved-1f1b")), uses_chunks(get_schedule("1f1b"))
    (True, False)
    """
    from schedcc.passes.collect import collect  # the pass imports this module

    # a schedule for one shape only (`schedcc.search.FoundOrder`) names it in `probe_shapes`
    for p, m in (*getattr(schedule_cls, "probe_shapes", ()), *_PROBE_SHAPES):
        try:
            program = collect(build_schedule(schedule_cls, p, m, num_chunks=2))
        except ScheduleConfigError:
            continue
        except ScheduleError:  # the schedule's own code fails: the grid says so, not the probe
            return True
        return any(op.chunk for ops in program.stages for op in ops if hasattr(op, "chunk"))
    return False


def chunks_hint(name: str, num_chunks: int) -> str:
    """The hint for a schedule that passes with one chunk per stage but fails with more."""
    return (
        f"hint: {name} passes with v=1 but fails with v={num_chunks}; if it is written for one "
        "chunk per stage, make its check() raise ScheduleConfigError when self.num_chunks != 1"
    )
