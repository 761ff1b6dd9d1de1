"""Speak `torch.distributed.pipelining`'s schedule text, both ways.

torch writes a schedule as one row of actions per pipeline rank: `2F0` is the forward of
microbatch 0 on (torch) stage 2, `1SEND_F0` sends its activation on, `3I1` and `3W1` are the split
backward, `0REDUCE_GRAD` ends a stage's backwards. torch's "stage index" is schedcc's *segment*,
its rank is schedcc's *stage*. This module maps a compiled `Program` to those rows (and to the
CSV that torch's `_PipelineScheduleRuntime._load_csv` reads), and a torch schedule (a built-in
one, built with mock stages, or a user's CSV) back to a schedcc `Schedule`, so schedcc can
validate, simulate and draw it.

    >>> import schedcc
    >>> from schedcc.interop.torch import to_torch_actions
    >>> program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    >>> to_torch_actions(program, comms=False)
    [['0F0', '0F1', '0B0', '0B1'], ['1F0', '1B0', '1F1', '1B1']]

torch itself is imported lazily, only by the functions that build or load torch objects.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from schedcc.errors import ScheduleConfigError
from schedcc.ir import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Comm,
    Forward,
    Instruction,
    OnMicrobatch,
    OverlappedBackward,
    Recompute,
    RecvActivation,
    RecvGrad,
    Reshard,
    SendActivation,
    SendGrad,
    Unshard,
)
from schedcc.program import Program
from schedcc.schedule import Schedule

__all__ = [
    "TorchSchedule",
    "format_actions",
    "from_torch_actions",
    "from_torch_csv",
    "to_torch_actions",
    "to_torch_csv",
    "torch_schedule",
]

#: schedcc instruction class <-> torch computation type.
_TO_TORCH: dict[type[Instruction], str] = {
    Forward: "F",
    Backward: "B",
    OverlappedBackward: "B",
    BackwardInput: "I",
    BackwardWeight: "W",
    SendActivation: "SEND_F",
    RecvActivation: "RECV_F",
    SendGrad: "SEND_B",
    RecvGrad: "RECV_B",
}
_FROM_TORCH = {code: cls for cls, code in _TO_TORCH.items() if cls is not OverlappedBackward}
#: ZeRO-3's gather and release, exported as torch's FSDP actions on the segment.
_SHARDING_TO_TORCH: dict[type[Instruction], str] = {Unshard: "UNSHARD", Reshard: "RESHARD"}
#: torch actions with no schedcc meaning on a single pipeline (FSDP, DP reduction): skipped.
_SKIPPED = ("REDUCE_GRAD", "UNSHARD", "RESHARD")
_ACTION = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|REDUCE_GRAD|UNSHARD|RESHARD|F|B|I|W)(\d*)")


# -- export -------------------------------------------------------------------------------------


def to_torch_actions(
    program: Program, *, comms: bool = True, copies_summed_by_caller: bool = False
) -> list[list[str]]:
    """`program` as torch action strings, one row per stage (torch: per rank).

    With `comms` (torch's "compute_comms" format) the rows hold schedcc's own sends and receives
    and a `REDUCE_GRAD` after each segment's last backward (where torch's runtime scales the
    gradients by 1/m); without, only the computes ("compute_only": torch inserts the rest).
    With `comms`, a `zero=3` program's `Unshard`/`Reshard` are torch's `UNSHARD`/`RESHARD` of
    the segment (for FSDP-wrapped stage modules), where schedcc placed and proved them. Other
    update instructions (Step, Reduce, Gather) are left out: the caller steps the optimizer.

    torch's actions have no gradient sum between copies of a parameter: a program with model
    replicas (DualPipe) or tied groups (`ReduceTied`) is refused, since under torch's runtime
    the copies would drift apart, unless `copies_summed_by_caller` says the caller sums each
    copy's gradients across its ranks before every optimizer step (as Megatron-LM does for a
    tied embedding).

    Raises:
        ScheduleConfigError: the program covers more than one batch (torch runs one per step),
            recomputes (torch's actions have no recompute), or has copies to sum (above).
    """
    schedule = program.schedule
    if schedule.num_batches != 1:
        raise ScheduleConfigError(
            f"torch runs one batch per step; compile {schedule!r} with num_batches=1 to export it"
        )
    if any(type(op) is Recompute for ops in program.stages for op in ops):
        raise ScheduleConfigError(
            "torch's pipeline actions have no recompute (R): compile without recompute to export"
        )
    if program.tied and not copies_summed_by_caller:
        what = "model replicas" if type(schedule).num_replicas > 1 else "tied parameters"
        raise ScheduleConfigError(
            f"{schedule!r} has {what} ({len(program.tied)} tied group(s)), whose copies schedcc "
            "sums with ReduceTied; torch's actions have no such sum, so the copies would drift "
            "apart: pass copies_summed_by_caller=True if you all-reduce each copy's gradients "
            "before every optimizer step"
        )
    rows = []
    for stage, ops in enumerate(program.stages):
        row: list[str] = []
        backwards: dict[int, int] = {}
        for op in ops:
            if comms and type(op) in _SHARDING_TO_TORCH:
                segment = schedule.segment_of(stage, op.chunk)
                row.append(f"{segment}{_SHARDING_TO_TORCH[type(op)]}")
                continue
            code = _TO_TORCH.get(type(op))
            if code is None or not isinstance(op, OnMicrobatch):
                continue
            if not comms and isinstance(op, Comm):
                continue
            segment = schedule.segment_of(stage, op.chunk)
            if type(op) is OverlappedBackward and row:  # with the forward right before it
                row[-1] = f"({row[-1]};{segment}{code}{op.microbatch})OVERLAP_F_B"
            else:
                row.append(f"{segment}{code}{op.microbatch}")
            if comms and isinstance(op, (Backward, BackwardWeight)):  # a weight gradient is done
                backwards[segment] = backwards.get(segment, 0) + 1
                if backwards[segment] == schedule.num_microbatches:
                    row.append(f"{segment}REDUCE_GRAD")
        rows.append(row)
    return rows


def to_torch_csv(
    program: Program,
    path: str | Path,
    *,
    comms: bool = True,
    copies_summed_by_caller: bool = False,
) -> Path:
    """Write `to_torch_actions(program, ...)` as a CSV, one row per rank.

    Load it with `_PipelineScheduleRuntime._load_csv(path, format="compute_comms")` (or
    `"compute_only"` when `comms=False`). Returns the path.
    """
    path = Path(path)
    with path.open("w", newline="") as file:
        rows = to_torch_actions(
            program, comms=comms, copies_summed_by_caller=copies_summed_by_caller
        )
        csv.writer(file).writerows(rows)
    return path


def format_actions(rows: Sequence[Sequence[object]]) -> str:
    """One line per rank, `rank 0: 0F0 0SEND_F0 ...`; `None` (an idle slot) is skipped."""
    return "\n".join(
        f"rank {rank}: " + " ".join(str(a) for a in row if a is not None)
        for rank, row in enumerate(rows)
    )


# -- import -------------------------------------------------------------------------------------


class TorchSchedule(Schedule):
    """A schedule read from torch's per-rank action rows: its order is exactly those rows.

    Build one with `from_torch_actions`, `from_torch_csv` or `torch_schedule`; the placement
    (which segments each rank holds) is read off the rows, chunk c being a rank's c-th smallest
    segment.
    """

    name = "torch"
    chunks = "any"  # as many as the rows place on a rank

    def __init__(
        self,
        stages: Sequence[Sequence[Instruction]],
        placement: dict[int, tuple[int, int]],
        num_microbatches: int,
        *,
        label: str = "torch",
    ) -> None:
        self._orders = tuple(tuple(ops) for ops in stages)
        self._placement = dict(placement)
        self.label = label
        num_chunks = max((chunk + 1 for _, chunk in placement.values()), default=1)
        super().__init__(len(self._orders), num_microbatches, num_chunks=num_chunks)

    def placement(self, segment: int) -> tuple[int, int]:
        return self._placement.get(segment, (-1, -1))

    def order(self, stage: int) -> Iterable[Instruction]:
        return iter(self._orders[stage])

    def __repr__(self) -> str:
        shape = f"p={self.num_stages}, m={self.num_microbatches}"
        if self.num_chunks > 1:
            shape += f", v={self.num_chunks}"
        return f"{self.label}({shape})"


def from_torch_actions(
    rows: Sequence[Iterable[object]] | dict[int, Iterable[object]],
    num_microbatches: int,
    *,
    label: str = "torch",
) -> TorchSchedule:
    """A `TorchSchedule` from torch's rows: `_Action` objects or their strings, `None` skipped.

    `rows[r]` (a list, or torch's `pipeline_order` dict) is rank r's actions. Computes become
    `Forward`/`Backward`/`BackwardInput`/`BackwardWeight`, sends and receives their schedcc
    counterparts, and `REDUCE_GRAD`/`UNSHARD`/`RESHARD` are dropped (schedcc inserts its own
    updates). An overlapped `(aFi;bBj)OVERLAP_F_B` becomes a `Forward` and the
    `OverlappedBackward` right after it (other overlapped parts run in order). Microbatch
    indices are kept as torch wrote them, so schedcc's checks see exactly torch's description.

    Raises:
        ScheduleConfigError: an action that does not parse, or ranks that do not hold the
            same number of segments, or segments that are not 0..n-1.

    >>> schedule = from_torch_actions([["0F0", "0B0"], ["1F0", "1B0"]], num_microbatches=1)
    >>> schedule.order(1).__next__()
    Forward(microbatch=0, chunk=0)
    """
    if isinstance(rows, dict):
        rows = [rows[rank] for rank in sorted(rows)]
    parsed = [
        [action for item in row for action in _parse(item, rank)] for rank, row in enumerate(rows)
    ]
    placement = _placement(parsed)
    stages = [
        [cls(microbatch, chunk=placement[segment][1]) for segment, cls, microbatch in row]
        for row in parsed
    ]
    return TorchSchedule(stages, placement, num_microbatches, label=label)


def from_torch_csv(path: str | Path, num_microbatches: int) -> TorchSchedule:
    """A `TorchSchedule` from a CSV in torch's format (one row of actions per rank).

    Raises:
        OSError: the file cannot be read.
        ScheduleConfigError: as `from_torch_actions`.
    """
    with Path(path).open(newline="") as file:
        rows = [[cell for cell in row if cell.strip()] for row in csv.reader(file)]
    return from_torch_actions(rows, num_microbatches, label=f"csv {Path(path).name}")


def _parse(item: object, rank: int) -> list[tuple[int, type[Instruction], int]]:
    """`(segment, instruction class, microbatch)` for one torch action (several if overlapped)."""
    if item is None:
        return []
    text = str(item).strip()
    if not text:
        return []
    if text.startswith("("):
        inner, _, kind = text[1:].partition(")")
        if kind != "OVERLAP_F_B":
            raise ScheduleConfigError(f"rank {rank}: cannot read torch action {text!r}")
        parts = [part for sub in inner.split(";") for part in _parse(sub, rank)]
        if [cls for _, cls, _ in parts] == [Forward, Backward]:
            parts[1] = (parts[1][0], OverlappedBackward, parts[1][2])
        return parts
    match = _ACTION.fullmatch(text)
    if match is None:
        raise ScheduleConfigError(
            f"rank {rank}: cannot read torch action {text!r}; expected e.g. 2F0, 1SEND_F0, 3W1"
        )
    segment, kind, microbatch = match.groups()
    if kind in _SKIPPED:
        return []
    if not microbatch:
        raise ScheduleConfigError(f"rank {rank}: torch action {text!r} has no microbatch")
    return [(int(segment), _FROM_TORCH[kind], int(microbatch))]


def _placement(
    parsed: list[list[tuple[int, type[Instruction], int]]],
) -> dict[int, tuple[int, int]]:
    """Segment -> (stage, chunk): the segments of each rank, sorted, are its chunks."""
    held = [sorted({segment for segment, _, _ in row}) for row in parsed]
    owner: dict[int, int] = {}
    for rank, segments in enumerate(held):
        for segment in segments:
            if owner.setdefault(segment, rank) != rank:
                raise ScheduleConfigError(
                    f"torch segment (stage index) {segment} appears on ranks {owner[segment]} "
                    f"and {rank}; each must live on one rank"
                )
    counts = {len(segments) for segments in held}
    if len(counts) != 1 or 0 in counts:
        raise ScheduleConfigError(
            f"every rank must hold the same number of segments, got {[len(s) for s in held]}"
        )
    if sorted(owner) != list(range(len(owner))):
        raise ScheduleConfigError(
            f"torch stage indices must be 0..{len(owner) - 1}, got {sorted(owner)}"
        )
    return {
        segment: (rank, chunk)
        for rank, segments in enumerate(held)
        for chunk, segment in enumerate(segments)
    }


# -- torch's built-in schedules -----------------------------------------------------------------


def torch_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    *,
    num_chunks: int | None = None,
    comms: bool = False,
) -> TorchSchedule:
    """The per-rank order that torch's built-in schedule `name` describes, as a schedcc schedule.

    `name` is a class of `torch.distributed.pipelining.schedules` (`Schedule1F1B`,
    `ScheduleGPipe`, `ScheduleInterleaved1F1B`, `ScheduleInterleavedZeroBubble`,
    `ScheduleZBVZeroBubble`, `ScheduleLoopedBFS`, ...) or a short name torch accepts (`1F1B`).
    torch needs live stages to build a schedule; this builds it with stand-in stages, reads its
    `pipeline_order` and converts that, unchanged, with `from_torch_actions`. With `comms`, it
    reads torch's own lowering with sends and receives (`pipeline_order_with_comms`, which the
    runtime-based schedules such as `ScheduleZBVZeroBubble` build), so schedcc checks and times
    torch's communication order too.

    Raises:
        ScheduleConfigError: an unknown name, a shape torch rejects, or a schedule without a
            per-rank order (with `comms`: without a lowered order).
    """
    cls = _torch_class(name)
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    single = issubclass(cls, PipelineScheduleSingle)
    chunks = 1 if single else (num_chunks or 2)
    if single and num_chunks not in (None, 1):
        raise ScheduleConfigError(f"torch's {cls.__name__} runs one chunk per rank")
    stages = [_mock_stage(num_stages, chunks) for _ in range(chunks)]
    try:
        instance = cls(stages[0] if single else stages, num_microbatches)
    except Exception as exc:  # torch's own checks raise ValueError, RuntimeError, assert, ...
        raise ScheduleConfigError(
            f"torch's {cls.__name__} rejects p={num_stages}, m={num_microbatches}, "
            f"v={chunks}: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        ) from exc
    attribute = "pipeline_order_with_comms" if comms else "pipeline_order"
    order = getattr(instance, attribute, None)
    if not isinstance(order, dict) or not order:
        raise ScheduleConfigError(f"torch's {cls.__name__} has no per-rank {attribute}")
    label = f"torch {cls.__name__}" + (" with comms" if comms else "")
    return from_torch_actions(order, num_microbatches, label=label)


def _torch_class(name: str) -> type:
    """torch's schedule class `name` (or a short name torch accepts), if it builds an order."""
    import inspect

    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, schedules._PipelineSchedule)):
        try:
            cls = schedules.get_schedule_class(name)
        except (ValueError, TypeError) as exc:
            raise ScheduleConfigError(
                f"unknown torch schedule {name!r}; one of {', '.join(_schedule_names())}"
            ) from exc
    if inspect.isabstract(cls) or not cls.__name__.startswith("Schedule"):
        raise ScheduleConfigError(
            f"torch's {cls.__name__} is a base class, not a schedule with a per-rank order; "
            f"name one of {', '.join(_schedule_names())}"
        )
    return cls


def _schedule_names() -> list[str]:
    """torch's concrete schedule classes (`Schedule1F1B`, ...), sorted."""
    import inspect

    from torch.distributed.pipelining import schedules

    return sorted(
        name
        for name, cls in vars(schedules).items()
        if name.startswith("Schedule")
        and isinstance(cls, type)
        and issubclass(cls, schedules._PipelineSchedule)
        and not inspect.isabstract(cls)
    )


def _mock_stage(num_stages: int, num_chunks: int):
    """A stand-in for torch's `PipelineStage`: what a schedule reads while it builds its order."""
    from unittest import mock

    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank = 0
    stage.group_size = num_stages
    stage.num_stages = num_stages * num_chunks
    stage.submod = None
    return stage
