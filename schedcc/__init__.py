"""schedcc: a pluggable, provable pipeline-parallel schedule compiler for PyTorch.

Write a schedule as a generator of instructions, then compile, validate, simulate, draw and run
it. Importing schedcc does not import torch; only `partition`, `split`, `tied_groups`, `export`
and the backends do, lazily.
"""

from __future__ import annotations

import os
from typing import Any

from schedcc import microbatches
from schedcc.compiler import compile
from schedcc.errors import (
    CheckpointError,
    DeadlockError,
    DependencyError,
    IncompleteScheduleError,
    MemoryBoundError,
    OffloadError,
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
    GradNorm,
    Instruction,
    Offload,
    OptimizerStep,
    OverlappedBackward,
    Recompute,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTied,
    Reload,
    Reshard,
    SendActivation,
    SendGrad,
    Unshard,
)
from schedcc.losses import TokenLoss
from schedcc.memory_model import MemoryModel
from schedcc.program import Program
from schedcc.registry import available_schedules, get_schedule
from schedcc.schedule import Schedule
from schedcc.search import search
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
    "Forward",
    "GatherParams",
    "GradNorm",
    "IncompleteScheduleError",
    "Instruction",
    "MemoryBoundError",
    "MemoryModel",
    "Offload",
    "OffloadError",
    "OptimizerStep",
    "OverlapError",
    "OverlappedBackward",
    "Program",
    "Recompute",
    "RecomputeError",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTied",
    "Reload",
    "Reshard",
    "Schedule",
    "ScheduleCodeError",
    "ScheduleConfigError",
    "ScheduleError",
    "SendActivation",
    "SendGrad",
    "Timeline",
    "TokenLoss",
    "UnknownScheduleError",
    "UnmatchedCommError",
    "Unshard",
    "UpdateOrderError",
    "WeightVersionError",
    "available_schedules",
    "compile",
    "export",
    "get_schedule",
    "microbatches",
    "search",
    "simulate",
    "tune",
    "validate",
]


def export(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """The whole model's state dict, read from a checkpoint directory; no process group needed.

    Every shard is checked as a load checks it (the manifest, each file's size and sha256, each
    shard's fields) and ZeRO-3 shards are joined, so each tensor is whole. The names are the
    unsplit model's where the segments keep the model's own module names (as `partition` and
    `split` cut it), else `segment<k>.<key>` (`backends.checkpoint.model.model_names`); the
    same names `Engine.state_dict()` gives. The tensors are on the CPU.

    Args:
        checkpoint_dir: a directory `Engine.save` (or `schedcc run --checkpoint`) wrote.

    Raises:
        CheckpointError: the checkpoint is incomplete, altered or unreadable.

    >>> # model.load_state_dict(schedcc.export("ckpt/step-00000100"))  # then save_pretrained
    """
    from schedcc.backends.checkpoint.model import export as read_whole

    return read_whole(checkpoint_dir)


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
