"""`MemoryModel`: the bytes a stage holds, per segment, for the simulator and the validator.

A program counts microbatch activations (`schedcc.semantics.memory`); a `MemoryModel` turns
them into bytes: what one microbatch's forward of each segment saves for its backward, and what
each segment's parameters, gradients and optimizer state take. Given by hand (sizes as numbers
or strings such as "64MiB"), or measured on the real segments with
`schedcc.backends.runtime.memory.measure_memory` (what the engines' `peak_activation_bytes`
count, the same way).

[Note: bytes per stage] At each point of a stage's program it holds, for each of its segments
k: the activations of the microbatches held there (each from its forward, or its `Recompute`,
to its last backward piece) times `activations[k]`, and the inputs (`inputs[k]`) that recomputed
forwards keep until their `Recompute`; its parameters (`parameters[k]`, plus one
stashed copy per extra weight version alive under 2BW: `Timeline.peak_versions`); its gradients
(`gradients[k]`, `parameters[k]` if not given; divided by `dp` under ZeRO-2, which keeps only
this rank's shard); its optimizer state (`optimizer[k]`, divided by `dp` under ZeRO-1 and 2).
Parameters, gradients and optimizer state are counted as held for the whole program (an upper
bound: gradients exist from the first backward to the step). ZeRO-3 shards the parameters
themselves: `resident_parameters` is the one place that says how many bytes of them stay.

    >>> from schedcc.memory import MemoryModel, parse_size
    >>> MemoryModel(activations="1KiB", parameters=[10, 20]).at("parameters", 1)
    20.0
    >>> parse_size("1.5GiB")
    1610612736
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import attrs

from schedcc.errors import ScheduleConfigError

__all__ = ["MemoryModel", "format_size", "parse_size", "resident_parameters"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str | float) -> int:
    """A byte count from `text`: a number with an optional unit (B, KB, MB, GB, TB in powers of
    1000; KiB, MiB, GiB, TiB in powers of 1024), e.g. "512MiB", "12GiB", "1.5e9".

    Raises:
        ScheduleConfigError: not a non-negative finite size with a known unit.

    >>> parse_size("512MiB"), parse_size("12GiB"), parse_size(100)
    (536870912, 12884901888, 100)
    """
    if isinstance(text, bool):
        raise ScheduleConfigError(f"expected a size such as 512MiB or 12GiB, got {text!r}")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = _SIZE.fullmatch(str(text))
        if match is None or match.group(2).lower() not in _UNITS:
            raise ScheduleConfigError(
                f"expected a size such as 512MiB, 12GiB or 1.5e9 (bytes), got {text!r}"
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    if not 0 <= value < math.inf:
        raise ScheduleConfigError(f"a size must be a finite number >= 0, got {text!r}")
    return round(value * _UNITS[unit])


def format_size(num_bytes: float) -> str:
    """`num_bytes` in the largest binary unit that keeps it >= 1 (e.g. "1.50 MiB").

    >>> format_size(1536 * 1024), format_size(12)
    ('1.50 MiB', '12 B')
    """
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:g} B"


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


def _checked(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScheduleConfigError(f"MemoryModel: expected a number of bytes, got {value!r}")
    return float(parse_size(value))


def resident_parameters(parameter_bytes: float, *, zero: int, data_parallel: int) -> float:
    """The bytes of a segment's parameters a rank keeps resident between uses.

    Every mode up to ZeRO-2 keeps whole parameters. [Hook: ZeRO-3] keeps only this rank's
    shard, `parameter_bytes / data_parallel`, between a chunk's gather and its release; the
    gathered copy during its computes belongs to the gather/release instructions' accounting.
    """
    if zero >= 3:
        return parameter_bytes / data_parallel
    return parameter_bytes


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

    Each is one size for every segment, or a list with one per segment (model order, length
    `p * v`); a size is a number of bytes or a string with a unit ("64MiB").

    Raises:
        ScheduleConfigError: a negative, non-numeric or unparsable size.
    """

    activations: float | tuple[float, ...] = attrs.field(default=0.0, converter=_sizes)
    parameters: float | tuple[float, ...] = attrs.field(default=0.0, converter=_sizes)
    optimizer: float | tuple[float, ...] = attrs.field(default=0.0, converter=_sizes)
    inputs: float | tuple[float, ...] = attrs.field(default=0.0, converter=_sizes)
    gradients: float | tuple[float, ...] | None = attrs.field(default=None, converter=_sizes)

    def at(self, field: str, segment: int) -> float:
        """The bytes of `field` ("activations", "parameters", "optimizer", "inputs",
        "gradients") of `segment`."""
        value = getattr(self, field)
        if value is None:  # gradients: as large as the parameters
            value = self.parameters
        if isinstance(value, tuple):
            return value[segment]
        return value

    def check(self, num_segments: int) -> None:
        """Raise `ScheduleConfigError` unless every per-segment list has `num_segments` sizes."""
        for field in ("activations", "parameters", "optimizer", "inputs", "gradients"):
            value = getattr(self, field)
            if isinstance(value, tuple) and len(value) != num_segments:
                raise ScheduleConfigError(
                    f"MemoryModel.{field} has {len(value)} sizes but the program has "
                    f"{num_segments} segments (p * v): give one per segment, or one for all"
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
        )


@attrs.frozen(slots=True)
class StageBytes:
    """What one stage holds at its peak, in bytes, by kind (see [Note: bytes per stage]).

    `activations` is the most held at once over the program; the others are held throughout.
    """

    activations: float
    parameters: float
    stashed: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.activations + self.parameters + self.stashed + self.gradients + self.optimizer


def chunk_sizes(program, memory: MemoryModel, stage: int, field: str) -> list[float]:
    """`field`'s bytes of each chunk's segment on `stage`, by chunk."""
    schedule = program.schedule
    return [memory.at(field, schedule.segment_of(stage, c)) for c in range(schedule.num_chunks)]


def static_bytes(program, memory: MemoryModel, stage: int, versions: int) -> StageBytes:
    """The bytes `stage` holds throughout (no activations): parameters, `versions - 1`
    stashed copies of them (2BW), gradients and optimizer state, sharded as ZeRO says."""
    dp, zero = program.data_parallel, program.zero
    params = sum(chunk_sizes(program, memory, stage, "parameters"))
    resident = resident_parameters(params, zero=zero, data_parallel=dp)
    grads = sum(chunk_sizes(program, memory, stage, "gradients"))
    state = sum(chunk_sizes(program, memory, stage, "optimizer"))
    return StageBytes(
        activations=0.0,
        parameters=resident,
        stashed=max(0, versions - 1) * params,
        gradients=grads / dp if zero >= 2 else grads,
        optimizer=state / dp if zero >= 1 else state,
    )
