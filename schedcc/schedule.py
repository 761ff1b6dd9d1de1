"""The `Schedule` base class a pipeline schedule is written against, and `VShape`.

A schedule says, for each stage, the order of its compute instructions (`order(stage)`) and the
chunk counts it supports (`chunks`); the compiler derives the communication, the data-parallel
updates and the weight versions. docs/schedules.md is the guide to writing one; docs/design.md
says what the compiler does with it.

    >>> from schedcc import Schedule, Forward, Backward
    >>> class GPipe(Schedule):
    ...     name = "my-gpipe"
    ...     def order(self, stage):
    ...         for b in range(self.num_batches):
    ...             yield from (Forward(i) for i in self.microbatches(b))
    ...             yield from (Backward(i) for i in reversed(self.microbatches(b)))
    >>> GPipe(num_stages=2, num_microbatches=4).microbatches(0)
    range(0, 4)
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from itertools import islice, takewhile
from typing import ClassVar, Literal

from schedcc.errors import ScheduleCodeError, ScheduleConfigError, call_user_code
from schedcc.ir import Instruction

__all__ = ["Chunks", "Schedule", "ScheduleCodeError", "VShape"]

#: What `Schedule.chunks` may be: the chunk counts v a schedule supports.
Chunks = tuple[int, ...] | range | Literal["any"]

_WORDS = {1: "one chunk", 2: "two chunks", 3: "three chunks", 4: "four chunks"}


class Schedule:
    """Base class of every schedule: subclass it, write `order(stage)`, declare `chunks`.

    Args:
        num_stages: pipeline ranks `p`, at least 1.
        num_microbatches: microbatches per optimizer step `m`, at least 1.
        num_chunks: segments per stage `v` ("virtual stages"), one of the class's `chunks`;
            None (the default) takes the class's `default_num_chunks`.
        num_batches: optimizer steps covered by one program `B`, at least 1.
        num_parts: sequence parts `k` each microbatch of the data is split into, at least 1
            and dividing `num_microbatches`, which then counts the parts (microbatch `i` is part
            `i % k`); None takes the class's `default_num_parts` (see [Note: sequence parts] in
            `schedcc.rules.parts`).
        seq_dim: the dim of every input and target tensor the parts split (with `num_parts >
            1`); None takes the class's `default_seq_dim`.

    Raises:
        ScheduleConfigError: an argument breaks a rule (a `num_chunks` outside `chunks`
            included); the message names it.
    """

    name: ClassVar[str] = ""
    #: The chunk counts v (segments per stage) the schedule supports: a tuple such as `(1,)` or
    #: `(2,)`, a `range` such as `range(1, 9)`, or `"any"` (every v >= 1). The constructor
    #: refuses any other `num_chunks`, and verify, tune and `schedcc.testing` try only these. A
    #: schedule that never mentions chunks runs one chunk per stage, which is what it is written
    #: for; one that reads `self.num_chunks` declares what it supports.
    chunks: ClassVar[Chunks] = (1,)
    #: The chunks per stage a schedule gets when `num_chunks` is not given; None: the smallest
    #: of `chunks`.
    default_num_chunks: ClassVar[int | None] = None
    #: The sequence parts per microbatch a schedule gets when `num_parts` is not given.
    default_num_parts: ClassVar[int] = 1
    #: The dim the parts split when `seq_dim` is not given (dim 1 of `(batch, seq, ...)`).
    default_seq_dim: ClassVar[int] = 1
    #: The forward of batch b uses weight version max(0, b - weight_delay).
    weight_delay: ClassVar[int] = 0
    #: How many replicas of the model the segments hold (see [Note: replicas]): replica r is
    #: segments `r*L .. (r+1)*L - 1` with `L = p*v / num_replicas`, segment `r*L + j` a copy of
    #: segment j, and each microbatch runs only the replica `replica_of` gives it.
    num_replicas: ClassVar[int] = 1

    def __init_subclass__(cls, **kwargs) -> None:
        """A subclass that defines only `steps(stage)`, the old name of `order(stage)`, still
        works for one release: its `order` calls `steps`, with one `DeprecationWarning` here."""
        super().__init_subclass__(**kwargs)
        owner = next(k for k in cls.__mro__ if "order" in vars(k) or "steps" in vars(k))
        if owner is cls and "order" not in vars(cls):
            warnings.warn(
                f"{cls.__qualname__} defines steps(stage); rename it to order(stage) (steps is "
                "read for one more release)",
                DeprecationWarning,
                stacklevel=2,
            )
            cls.order = _order_from_steps  # type: ignore[method-assign]

    def __init__(
        self,
        num_stages: int,
        num_microbatches: int,
        num_chunks: int | None = None,
        num_batches: int = 1,
        *,
        num_parts: int | None = None,
        seq_dim: int | None = None,
    ) -> None:
        if num_chunks is None:
            num_chunks = type(self).default_num_chunks or _smallest(_checked_chunks(type(self)))
        if num_parts is None:
            num_parts = type(self).default_num_parts
        if seq_dim is None:
            seq_dim = type(self).default_seq_dim
        for arg, value in [
            ("num_stages", num_stages),
            ("num_microbatches", num_microbatches),
            ("num_chunks", num_chunks),
            ("num_batches", num_batches),
            ("num_parts", num_parts),
        ]:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScheduleConfigError(
                    f"{type(self).__name__}: {arg} must be a positive integer, got {value!r}"
                )
        if not type(self).supports_chunks(num_chunks):
            raise ScheduleConfigError(_refusal(type(self), num_chunks))
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.num_chunks = num_chunks
        self.num_batches = num_batches
        self.num_parts = num_parts
        self.seq_dim = seq_dim
        owner = type(self).__name__
        _check_parts(self, owner)
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

    def order(self, stage: int) -> Iterable[Instruction]:
        """Yield stage `stage`'s instructions in the order it runs them."""
        raise NotImplementedError(f"{type(self).__name__} must define order(stage)")

    def steps(self, stage: int) -> Iterable[Instruction]:
        """The old name of `order(stage)`, read for one more release (docs/schedules.md)."""
        warnings.warn(
            "Schedule.steps(stage) is now Schedule.order(stage)", DeprecationWarning, stacklevel=2
        )
        return self.order(stage)

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

    @classmethod
    def supports_chunks(cls, num_chunks: int) -> bool:
        """Whether `num_chunks` is one of the class's `chunks`.

        Raises:
            ScheduleConfigError: `chunks` is not a tuple or range of positive ints, or "any".
        """
        chunks = _checked_chunks(cls)
        return chunks == "any" or num_chunks in chunks

    @classmethod
    def chunk_counts(cls, limit: int, *, first: int | None = None) -> tuple[int, ...]:
        """The class's chunk counts up to `limit`, ascending, at most the `first` few: what a
        grid of shapes tries (`schedcc verify` and `tune` take the first two).

        >>> class Even(Schedule):
        ...     chunks = range(2, 9, 2)
        >>> Schedule.chunk_counts(4), VShape.chunk_counts(4), Even.chunk_counts(64, first=2)
        ((1,), (2,), (2, 4))
        """
        counts = takewhile(lambda v: v <= limit, _ascending(_checked_chunks(cls), limit))
        return tuple(islice(counts, first))

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

    def part_of(self, microbatch: int) -> int:
        """The sequence part a microbatch index is: `microbatch % num_parts` (0 without parts).

        >>> Schedule(2, 8, num_parts=4).part_of(6)
        2
        """
        return microbatch % self.num_parts

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
        if self.num_parts > 1:
            shape += f", parts={self.num_parts}"
        return f"{type(self).__name__}({shape})"


def _check_parts(schedule: Schedule, owner: str) -> None:
    """`num_parts` divides the microbatches of one model replica, and `seq_dim` is an int."""
    parts, seq_dim = schedule.num_parts, schedule.seq_dim
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        raise ScheduleConfigError(f"{owner}: seq_dim must be an integer dim, got {seq_dim!r}")
    if parts == 1:
        return
    if schedule.num_microbatches % parts:
        raise ScheduleConfigError(
            f"{owner}: num_parts={parts} must divide num_microbatches="
            f"{schedule.num_microbatches} (each microbatch of the data becomes {parts} "
            f"consecutive microbatch indices); pass a multiple of {parts}"
        )
    if type(schedule).num_replicas != 1:
        raise ScheduleConfigError(
            f"{owner}: sequence parts need one model replica (num_replicas=1); a part's carry "
            "stays on its segment, which a second replica does not hold"
        )


def _is_place(placed: object, num_stages: int, num_chunks: int) -> bool:
    """Whether `placed` is a `(stage, chunk)` pair of ints in range."""
    if not isinstance(placed, (tuple, list)) or len(placed) != 2:
        return False
    bounds = (num_stages, num_chunks)
    return all(
        isinstance(index, int) and not isinstance(index, bool) and 0 <= index < bound
        for index, bound in zip(placed, bounds)
    )


def _order_from_steps(self: Schedule, stage: int) -> Iterable[Instruction]:
    """`order(stage)` of a class that defines only the old `steps(stage)`."""
    return self.steps(stage)


def _checked_chunks(cls: type[Schedule]) -> Chunks:
    """`cls.chunks`, if it is "any" or a non-empty tuple or range of positive ints."""
    chunks = cls.chunks
    if isinstance(chunks, str) and chunks == "any":
        return "any"
    if isinstance(chunks, range) and len(chunks) > 0 and min(chunks[0], chunks[-1]) >= 1:
        return chunks
    if (
        isinstance(chunks, tuple)
        and len(chunks) > 0
        and all(type(v) is int and v >= 1 for v in chunks)
    ):
        return chunks
    raise ScheduleConfigError(
        f"{cls.__name__}.chunks must be a tuple such as (1,), a range such as range(1, 9) or "
        f'"any", of positive chunk counts; got {chunks!r}'
    )


def _smallest(chunks: Chunks) -> int:
    """The smallest chunk count of a checked `chunks`."""
    return next(iter(_ascending(chunks, 1)))


def _ascending(chunks: Chunks, upto: int) -> Iterable[int]:
    """A checked `chunks` in ascending order; "any" as `1, 2, ..., upto`."""
    if chunks == "any":
        return range(1, upto + 1)
    if isinstance(chunks, range):
        return chunks if chunks.step > 0 else chunks[::-1]
    return sorted(set(chunks))


def _refusal(cls: type[Schedule], num_chunks: int) -> str:
    """Why `cls` does not take `num_chunks`, naming its `chunks` and the fix."""
    chunks = _checked_chunks(cls)
    name = cls.name or cls.__name__
    if isinstance(chunks, tuple) and len(set(chunks)) == 1:
        only = chunks[0]
        runs = f"exactly {_WORDS.get(only, f'{only} chunks')} per stage (its chunks = {chunks!r})"
        fix = f"pass num_chunks={only} (-v {only})"
    else:
        runs, fix = f"only the chunk counts in its chunks = {chunks!r}", "pass one of those"
    return (
        f"{name} runs {runs}, got num_chunks={num_chunks}; {fix}, or declare the counts it "
        "supports in its chunks"
    )


class VShape(Schedule):
    """Base of the schedules that hold two chunks per stage in a V (zb-v, dualpipe-v, v-half,
    v-min, dualpipe): segment k < p on stage k as chunk 0, segment k >= p on stage 2p - 1 - k as
    chunk 1, down the stages and back up. `chunks` is `(2,)`.

    >>> class Mine(VShape):
    ...     def order(self, stage):
    ...         yield from ()
    >>> [Mine(2, 1).placement(k) for k in range(4)]
    [(0, 0), (1, 0), (1, 1), (0, 1)]
    """

    chunks = (2,)

    def placement(self, segment: int) -> tuple[int, int]:
        """Segment k < p on (k, 0), segment k >= p on (2p - 1 - k, 1): down and back up."""
        p = self.num_stages
        return (segment, 0) if segment < p else (2 * p - 1 - segment, 1)
