"""The `Schedule` base class a pipeline schedule is written against.

A schedule says, for each stage, the order of its compute instructions; the compiler derives the
communication, the data-parallel updates and the weight versions. See DESIGN.md, "Writing a
schedule".

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

from collections.abc import Iterable
from typing import ClassVar

from schedcc.errors import ScheduleConfigError
from schedcc.ir import Instruction

__all__ = ["Schedule"]


class Schedule:
    """Base class of every schedule: subclass it and write `steps(stage)`.

    Args:
        num_stages: pipeline ranks `p`, at least 1.
        num_microbatches: microbatches per optimizer step `m`, at least 1.
        num_chunks: segments per stage `v` ("virtual stages"), at least 1.
        num_batches: optimizer steps covered by one program `B`, at least 1.

    Raises:
        ScheduleConfigError: an argument breaks a rule; the message names it.
    """

    name: ClassVar[str] = ""
    #: The forward of batch b uses weight version max(0, b - weight_delay).
    weight_delay: ClassVar[int] = 0

    def __init__(
        self,
        num_stages: int,
        num_microbatches: int,
        num_chunks: int = 1,
        num_batches: int = 1,
    ) -> None:
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
        self.check()
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
            placed = self.placement(segment)
            stage, chunk = placed
            if not (0 <= stage < p and 0 <= chunk < v) or table[stage][chunk] is not None:
                raise ScheduleConfigError(
                    f"{type(self).__name__}.placement({segment}) = {placed} is out of range or "
                    f"taken: placement must map the {p * v} segments one-to-one onto "
                    f"(stage < {p}, chunk < {v})"
                )
            table[stage][chunk] = segment
        return tuple(tuple(row) for row in table)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        shape = f"p={self.num_stages}, m={self.num_microbatches}"
        if self.num_chunks > 1:
            shape += f", v={self.num_chunks}"
        if self.num_batches > 1:
            shape += f", batches={self.num_batches}"
        return f"{type(self).__name__}({shape})"
