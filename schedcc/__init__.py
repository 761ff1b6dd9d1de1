"""schedcc: a pluggable, provable pipeline-parallel schedule compiler for PyTorch.

Write a schedule as a generator of instructions, then compile, validate, simulate, draw and run
it. Importing schedcc does not import torch; only `partition`, `split`, `tied_groups` and the
backends do, lazily.
"""

from __future__ import annotations

from schedcc.compiler import compile
from schedcc.errors import (
    CheckpointError,
    DeadlockError,
    DependencyError,
    IncompleteScheduleError,
    MemoryBoundError,
    OverlapError,
    RecomputeError,
    ScheduleCodeError,
    ScheduleConfigError,
    ScheduleError,
    UnknownScheduleError,
    UnmatchedCommError,
    UpdateOrderError,
    WeightVersionError,
)
from schedcc.ir import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    GatherParams,
    Instruction,
    OptimizerStep,
    OverlappedBackward,
    Recompute,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTied,
    Reshard,
    SendActivation,
    SendGrad,
    Unshard,
)
from schedcc.program import Program
from schedcc.registry import available_schedules, get_schedule
from schedcc.schedule import Schedule
from schedcc.simulate import CostModel, Timeline, simulate
from schedcc.tune import tune
from schedcc.validate import validate

__version__ = "0.1.0"

__all__ = [
    "Backward",
    "BackwardInput",
    "BackwardWeight",
    "CheckpointError",
    "CostModel",
    "DeadlockError",
    "DependencyError",
    "OverlapError",
    "Forward",
    "GatherParams",
    "IncompleteScheduleError",
    "Instruction",
    "MemoryBoundError",
    "OptimizerStep",
    "OverlappedBackward",
    "Program",
    "Recompute",
    "RecomputeError",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTied",
    "Reshard",
    "Schedule",
    "ScheduleCodeError",
    "ScheduleConfigError",
    "ScheduleError",
    "SendActivation",
    "SendGrad",
    "Timeline",
    "UnknownScheduleError",
    "UnmatchedCommError",
    "Unshard",
    "UpdateOrderError",
    "WeightVersionError",
    "available_schedules",
    "compile",
    "get_schedule",
    "simulate",
    "tune",
    "validate",
]


def __getattr__(name: str):
    """`schedcc.partition`, `schedcc.split` and `schedcc.tied_groups`, imported on first use
    (they need torch)."""
    if name == "partition":
        from schedcc.partitioning import partition

        globals()["partition"] = partition
        return partition
    if name in ("split", "tied_groups"):
        from schedcc import splitting

        globals()[name] = getattr(splitting, name)
        return globals()[name]
    raise AttributeError(f"module 'schedcc' has no attribute {name!r}")
