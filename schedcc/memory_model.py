"""`MemoryModel`: the bytes of each segment, the input of every byte count.

What one microbatch's forward of each segment saves for its backward, and what each segment's
parameters, gradients and optimizer state take. Given by hand (sizes as numbers or strings such
as "64MiB", read by `schedcc.sizes.parse_size`), or measured on the real segments with
`schedcc.backends.runtime.memory.measure_memory` (what the engines' `peak_activation_bytes`
count, the same way). `schedcc.semantics.stage_bytes` turns it into the bytes a stage holds at
each point of its program ([Note: bytes per stage]).

    >>> from schedcc import MemoryModel
    >>> MemoryModel(activations="1KiB", parameters=[10, 20]).at("parameters", 1)
    20.0
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from os import PathLike

import attrs

from schedcc.draw.chrome import read_chrome_trace
from schedcc.errors import ScheduleConfigError
from schedcc.sizes import parse_size

__all__ = ["SIZE_FIELDS", "MemoryModel"]

#: the fields of a `MemoryModel` that hold one size, or one per segment
SIZE_FIELDS = ("activations", "parameters", "optimizer", "inputs", "gradients")


def _sizes(value: object) -> float | tuple[float, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, int, float)):
        return float(parse_size(value)) if isinstance(value, str) else _checked(value)
    if isinstance(value, Sequence):
        return tuple(float(parse_size(v)) if isinstance(v, str) else _checked(v) for v in value)
    raise ScheduleConfigError(
        f"MemoryModel: a size is a number of bytes, a string such as '64MiB', or one per "
        f"segment in a list; got {value!r}"
    )


def _part_sizes(value: object) -> tuple[tuple[float, ...], ...] | None:
    if value is None:
        return None
    if isinstance(value, Sequence) and not isinstance(value, str):
        rows = tuple(_sizes(row) for row in value)
        if rows and all(isinstance(row, tuple) and row for row in rows):
            return rows  # type: ignore[return-value]
    raise ScheduleConfigError(
        f"MemoryModel: part_activations is one tuple of sizes per segment (one per sequence "
        f"part); got {value!r}"
    )


def _checked(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScheduleConfigError(f"MemoryModel: expected a number of bytes, got {value!r}")
    return float(parse_size(value))


# [Note: a measured cut] Bytes measured on real segments (`MemoryModel.from_trace`,
# `measure_memory`) are each segment's own, on the cut they were measured on. A cut in 2p does not
# keep half of each segment of a cut in p (each segment saves its own boundaries: the MLP of
# `schedcc run --model mlp` cut in 4 saves 512, 512, 512 and 768 bytes a sample pair where cut in 2
# it saves 768 and 1024), and a V puts the loss segment on stage 0. So such a model carries its
# `cut` (one replica's segments), and `tune` and `search` take its sizes as they are, each
# segment its own, for programs that cut the model the same way (p * v / R segments a replica, in
# any placement: looped, the V, DualPipe's two replicas of a cut in p); a program of another cut
# is skipped by `tune` (with the reason) and not searched by `search`. Sizes given by hand (`cut`
# None) are a stage's at v = 1 and each chunk holds 1/v of them ([Note: tune's units]).


@attrs.frozen(slots=True)
class MemoryModel:
    """Bytes per segment (see [Note: bytes per stage]).

    Args:
        activations: what one microbatch's forward of a segment saves for its backward.
        parameters: a segment's parameters.
        optimizer: a segment's optimizer state (e.g. 2x parameters for Adam, 0 for plain SGD).
        inputs: one microbatch's input of a segment (what a recomputed forward keeps until
            its `Recompute`).
        gradients: a segment's gradients (None: the same as `parameters`).
        part_activations: with sequence parts ([Note: sequence parts] in
            `schedcc.rules.parts`), what each part's forward of a segment saves, one tuple of
            `k` sizes per segment (part j's includes what it saves of the carry it took), in
            place of `activations`; None: every part saves `activations`.
        cut: the number of segments the sizes were measured on, one model replica's (`p * v /
            R`), as `from_trace` and `measure_memory` set it ([Note: a measured cut]); None:
            sizes given by hand.

    Each is one size for every segment, or a list with one per segment (model order, length
    `p * v`); a size is a number of bytes or a string with a unit ("64MiB").

    Raises:
        ScheduleConfigError: a negative, non-numeric or unparsable size, or a `cut` its lists
            are not the length of.
    """

    activations: float | tuple[float, ...] = attrs.field(default=0.0, converter=_sizes)
    parameters: float | tuple[float, ...] = attrs.field(default=0.0, converter=_sizes)
    optimizer: float | tuple[float, ...] = attrs.field(default=0.0, converter=_sizes)
    inputs: float | tuple[float, ...] = attrs.field(default=0.0, converter=_sizes)
    gradients: float | tuple[float, ...] | None = attrs.field(default=None, converter=_sizes)
    part_activations: tuple[tuple[float, ...], ...] | None = attrs.field(
        default=None, converter=lambda value: _part_sizes(value)
    )
    cut: int | None = attrs.field(default=None, kw_only=True)

    @cut.validator
    def _cut(self, attribute, value) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleConfigError(
                f"MemoryModel.cut must be a positive number of segments or None, got {value!r}"
            )
        for field in (*SIZE_FIELDS, "part_activations"):
            sizes = getattr(self, field)
            if isinstance(sizes, tuple) and len(sizes) != value:
                raise ScheduleConfigError(
                    f"MemoryModel.{field} has {len(sizes)} sizes for a cut in {value} segments"
                )

    @classmethod
    def from_trace(cls, trace: str | PathLike | Iterable[Mapping]) -> MemoryModel:
        """The bytes a run measured per segment of its cut (p·v of them, model order): what one
        microbatch's forward saved and its input took, from the trace `schedcc run --trace`
        writes ([Note: a trace's bytes] in `schedcc.backends.run.report`). Parameters,
        gradients and optimizer state are 0, so a byte limit with this model is one on a
        stage's activations, as the run's "peak activations" rows count them. The sizes hold
        for that cut (`cut`, [Note: a measured cut]): `search` and `tune` take them for orders
        of a model cut the same way.

        Raises:
            ScheduleConfigError: the trace records no bytes (not written by `schedcc run
                --trace`), or records them malformed.
            OSError: the file cannot be read.
        """
        _, metadata = read_chrome_trace(trace)
        memory = metadata.get("memory")
        if memory is None:
            raise ScheduleConfigError(
                f"trace {trace if isinstance(trace, (str, PathLike)) else '(events)'} records "
                "no measured bytes (schedcc run --trace writes them): give the limit in "
                "microbatches, or the bytes yourself (a MemoryModel; --memory activations=...)"
            )
        sizes = {}
        for field in ("activations", "inputs"):
            value = memory.get(field) if isinstance(memory, Mapping) else None
            if (
                not isinstance(value, list)
                or not value
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
            ):
                raise ScheduleConfigError(
                    f"trace: its measured bytes must hold {field!r}, a list of numbers per "
                    f"segment; got {memory!r}"
                )
            sizes[field] = value
        if len(sizes["activations"]) != len(sizes["inputs"]):
            raise ScheduleConfigError(
                f"trace: its measured bytes give {len(sizes['activations'])} segments' "
                f"activations but {len(sizes['inputs'])} segments' inputs"
            )
        return cls(**sizes, cut=len(sizes["activations"]))

    def part_sizes(self, segment: int) -> tuple[float, ...] | None:
        """What each sequence part's forward of `segment` saves, or None (see the Args)."""
        parts = self.part_activations
        return None if parts is None else parts[segment % len(parts)]

    def at(self, field: str, segment: int) -> float:
        """The bytes of `field` ("activations", "parameters", "optimizer", "inputs",
        "gradients") of `segment`."""
        value = getattr(self, field)
        if value is None:  # gradients: as large as the parameters
            value = self.parameters
        if isinstance(value, tuple):
            return value[segment % len(value)]  # one replica's sizes stand for every copy
        return value

    def check(self, num_segments: int, num_replicas: int = 1) -> None:
        """Raise `ScheduleConfigError` unless every per-segment list has `num_segments` sizes,
        or, with model replicas (DualPipe), one replica's `num_segments / num_replicas`: segment
        `r * L + j` is a copy of segment `j` and has its sizes."""
        allowed = {num_segments, num_segments // num_replicas}
        for field in SIZE_FIELDS:
            value = getattr(self, field)
            if isinstance(value, tuple) and len(value) not in allowed:
                raise ScheduleConfigError(
                    f"MemoryModel.{field} has {len(value)} sizes but the program has "
                    f"{num_segments} segments (p * v): give one per segment, or one for all"
                )
        parts = self.part_activations
        if parts is not None and len(parts) not in allowed:
            raise ScheduleConfigError(
                f"MemoryModel.part_activations has {len(parts)} segments' sizes but the program "
                f"has {num_segments} segments (p * v): give one tuple of part sizes per segment"
            )

    def scaled(self, factor: float) -> MemoryModel:
        """Every size times `factor` (`schedcc.tune`: a chunk of a stage cut in v is 1/v)."""

        def times(value):
            if value is None:
                return None
            return tuple(v * factor for v in value) if isinstance(value, tuple) else value * factor

        return MemoryModel(
            activations=times(self.activations),
            parameters=times(self.parameters),
            optimizer=times(self.optimizer),
            inputs=times(self.inputs),
            gradients=times(self.gradients),
            part_activations=None
            if self.part_activations is None
            else tuple(times(parts) for parts in self.part_activations),
            cut=self.cut,
        )
