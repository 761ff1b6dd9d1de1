"""Every error schedcc raises at a user.

`ScheduleError` covers a schedule or program that is wrong; each validator rule raises its own
subclass. `ScheduleConfigError` is a bad argument to a schedule (a `ValueError`), raised before
anything is compiled. `UnknownScheduleError` is a name that resolves to no schedule. The
backends raise the last three: `RuntimeInstructionError` (a stage runtime cannot run an
instruction), `RankFailure` (a distributed rank failed or timed out) and `UserError` (a bad
`schedcc run` request). This module imports no torch.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "DeadlockError",
    "DependencyError",
    "IncompleteScheduleError",
    "MemoryBoundError",
    "OverlapError",
    "PartitionError",
    "RankFailure",
    "RecomputeError",
    "RuntimeInstructionError",
    "ScheduleCodeError",
    "ScheduleConfigError",
    "ScheduleError",
    "ShardingError",
    "UnknownScheduleError",
    "UnmatchedCommError",
    "UpdateOrderError",
    "UserError",
    "WeightVersionError",
]


class ScheduleError(Exception):
    """A schedule or compiled program that cannot run correctly.

    Attributes:
        stage: the stage where the problem shows, or None.
        position: the index in that stage's program, or None.
    """

    def __init__(self, message: str, *, stage: int | None = None, position: int | None = None):
        super().__init__(message)
        self.stage = stage
        self.position = position


class IncompleteScheduleError(ScheduleError):
    """A (microbatch, segment) is not forwarded or backwarded exactly once, on its own stage."""


class DependencyError(ScheduleError):
    """A compute runs before what it needs on its own stage."""


class UnmatchedCommError(ScheduleError):
    """A send without its receive, a receive without its send, or FIFO order differs."""


class DeadlockError(ScheduleError):
    """The stages wait on each other in a cycle."""


class WeightVersionError(ScheduleError):
    """A compute needs a weight version that is not produced yet or is gone."""


class MemoryBoundError(ScheduleError):
    """A stage would hold more microbatch activations than allowed."""


class ScheduleConfigError(ScheduleError, ValueError):
    """A bad argument to a schedule or to the compiler, named with the rule it breaks."""


class UnknownScheduleError(ScheduleError, LookupError):
    """A schedule name that is not registered and is not `module:Class` or `file.py:Class`."""


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, altered, unsafe, or made for another program."""


# -- raised by the backends (`schedcc.backends`) --------------------------------------------------


class RuntimeInstructionError(ScheduleError):
    """An instruction a backend's stage runtime cannot execute (unknown, or its inputs missing)."""


class RankFailure(RuntimeError):
    """Training on this rank failed (a peer died, a wait timed out); printed as one line, exit 1."""


class UserError(Exception):
    """A mistake in what the user asked `schedcc run` for: one line from the rank, exit 2."""


# -- appended by the validator's update rules ---------------------------------------------------


class UpdateOrderError(DependencyError):
    """A ReduceGrads, OptimizerStep or GatherParams out of place on its stage.

    A step before its batch's gradients are all in and reduced, a reduction with nothing to
    reduce, a `GatherParams` without ZeRO, or, under ZeRO, a chunk whose updated weights are not
    gathered before its next compute or the end of the program. A subclass of `DependencyError`
    (what these problems raised before they had their own rules).
    """


class OverlapError(DependencyError):
    """An overlapped backward (`+B1`) that does not directly follow, on its stage, a forward it
    can overlap: one that makes nothing the backward needs (see [Note: overlapped pairs])."""


class ScheduleCodeError(ScheduleError):
    """A schedule's own code failed or broke the `Schedule` contract: its constructor, `check()`,
    `placement()` or `steps()` raised, or `steps()` returned or yielded something that is not an
    instruction in range. The message names the class and the method; `__cause__` holds the
    original exception where there was one.
    """


class RecomputeError(DependencyError):
    """A `Recompute` out of place: before its forward, after its microbatch's first backward
    piece on that chunk, or a second time (see `schedcc.rules.recompute`)."""


class PartitionError(ScheduleConfigError):
    """A model that cannot be cut as asked (too few layers, bad boundaries, unknown method)."""


class ShardingError(DependencyError):
    """ZeRO-3's `Unshard`/`Reshard` out of place on a stage: a compute on a chunk whose
    parameters are released, an `Unshard` of a chunk already whole or a `Reshard` of one that is
    not (or whose gradients are not yet reduced), a chunk left whole across a step or at the end
    of the program, or either instruction in a program not compiled with `zero=3`."""
