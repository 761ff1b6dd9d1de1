"""Every error schedcc raises at a user.

`ScheduleError` covers a schedule or program that is wrong; each validator rule raises its own
subclass. `ScheduleConfigError` is a bad argument to a schedule (a `ValueError`), raised before
anything is compiled. `UnknownScheduleError` is a name that resolves to no schedule. The
backends raise the last three: `RuntimeInstructionError` (a stage runtime cannot run an
instruction), `RankFailure` (a distributed rank failed or timed out) and `UserError` (a bad
`schedcc run` request). `UserCodeError` is a user's function that failed (a model's forward,
`loss_fn`, an optimizer factory); `call_user` is the one guard every call of user code goes
through (see [Note: the user-code guard]). This module imports no torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TypeVar

__all__ = [
    "CheckpointError",
    "DeadlockError",
    "DependencyError",
    "IncompleteScheduleError",
    "MemoryBoundError",
    "OffloadError",
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
    "UserCodeError",
    "USER_FILE_MODULE",
    "UserError",
    "WeightVersionError",
    "call_user",
    "call_user_code",
    "describe",
    "first_line",
    "name_of",
]

_T = TypeVar("_T")


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
    `placement()` or `order()` raised, or `order()` returned or yielded something that is not an
    instruction in range. The message names the class and the method; `__cause__` holds the
    original exception where there was one.
    """


class RecomputeError(DependencyError):
    """A `Recompute` out of place: before its forward, after its microbatch's first backward
    piece on that chunk, or a second time (see `schedcc.rules.recompute`)."""


class OffloadError(DependencyError):
    """An `Offload` or `Reload` out of place: a backward piece or a send of a microbatch whose
    activations are on the host, an offload before its forward, after its backward began, of a
    recomputed forward or a second time, or a reload of activations not offloaded (see
    `schedcc.rules.offload`)."""


class PartitionError(ScheduleConfigError):
    """A model that cannot be cut as asked (too few layers, bad boundaries, unknown method)."""


class ShardingError(DependencyError):
    """ZeRO-3's `Unshard`/`Reshard` out of place on a stage: a compute on a chunk whose
    parameters are released, an `Unshard` of a chunk already whole or a `Reshard` of one that is
    not (or whose gradients are not yet reduced), a chunk left whole across a step or at the end
    of the program, or either instruction in a program not compiled with `zero=3`."""


class UserCodeError(ScheduleConfigError):
    """A user's function failed: a segment's forward, `loss_fn`, an optimizer factory, or a
    `--model`'s `batch` inside a rank. The message names the function and the exception's first
    line; `__cause__` holds the original exception. `schedcc run` prints it as one line, exit 1.
    """


# -- the user-code guard ------------------------------------------------------------------------

# [Note: the user-code guard] schedcc calls code a user wrote (a schedule's constructor,
# `check()`, `placement()`, `order()`; a recompute policy; a `--model` factory and its `batch`; a
# segment's forward, `loss_fn`, an optimizer factory) only through `call_user`. Whatever that
# code raises, `SystemExit` and `GeneratorExit` included, becomes one typed error naming the
# function, so a schedule that calls `sys.exit(0)` cannot make `schedcc verify` exit 0 with
# nothing said, and a rank knows a failure of the user's code from one of its own. Only
# `KeyboardInterrupt` (the user asked to stop) and schedcc's own errors pass unchanged: a
# `check()` that raises `ScheduleConfigError` says the fix itself, and a `RankFailure` (or, in
# the backends, a torch `DistError`) from a collective inside a forward (tensor-parallel layers)
# is a lost peer, not the user's mistake.

#: What `call_user` lets through unchanged, besides the `passing` its caller adds.
_OWN = (KeyboardInterrupt, ScheduleError, RankFailure, UserError)


def call_user(
    function: str | Callable[[], str],
    call: Callable[[], _T],
    *,
    error: type[Exception] = UserCodeError,
    where: str = "",
    hint: str = "",
    passing: tuple[type[BaseException], ...] = (),
) -> _T:
    """`call()`, the one guard around a user's code (see [Note: the user-code guard]).

    Args:
        function: what the message calls the code, e.g. `"loss_fn m.loss"`, or a callable that
            says it (built only on a failure: a forward's name costs nothing on the hot path).
        call: the call, without arguments.
        error: the error raised instead (`ScheduleCodeError` for a schedule's code).
        where: a prefix naming the context, e.g. the schedule's repr.
        hint: the fix, appended after a semicolon.
        passing: more exception types to let through unchanged.

    Raises:
        error: `call()` raised anything but a `KeyboardInterrupt`, a schedcc error or `passing`;
            one line, `where: function raised Type: first line; hint`, from the exception.

    >>> call_user("make()", lambda: 3)
    3
    >>> call_user("loss_fn f", lambda: exit(0))
    Traceback (most recent call last):
    ...
    schedcc.errors.UserCodeError: loss_fn f raised SystemExit: 0
    """
    try:
        return call()
    except _OWN:
        raise
    except passing:
        raise
    except BaseException as exc:
        name = function if isinstance(function, str) else function()
        message = f"{where}: {name}" if where else name
        message += f" raised {first_line(exc)}"
        raise error(f"{message}; {hint}" if hint else message) from exc


def call_user_code(
    owner: str, method: str, call: Callable[[], _T], *, where: str = "", hint: str = ""
) -> _T:
    """`call_user` for a schedule's code: anything `call()` raises but a schedcc error or
    `KeyboardInterrupt`, `SystemExit` included, is a `ScheduleCodeError` that names
    `owner.method` (one line: `where`, the original message's first line, `hint`).

    >>> call_user_code("Mine", "order(0)", lambda: 1 / 0, where="Mine(p=2, m=2)")
    Traceback (most recent call last):
    ...
    schedcc.errors.ScheduleCodeError: Mine(p=2, m=2): Mine.order(0) raised ZeroDivisionError: ...
    """
    return call_user(f"{owner}.{method}", call, error=ScheduleCodeError, where=where, hint=hint)


def describe(value: object) -> str:
    """`repr(value)` through the guard, or, when the value's own `__repr__` fails, the form its
    root class gives (a schedule's `Schedule.__repr__`: `Mine(p=2, m=4)`)."""
    try:
        return call_user("__repr__()", lambda: repr(value))
    except UserCodeError:
        bases = reversed(type(value).__mro__[:-1])  # from the root down, object left out
        root = next((cls for cls in bases if "__repr__" in vars(cls)), object)
        return root.__repr__(value)


def first_line(exc: BaseException) -> str:
    """`Type: the first line of its message` (or `Type` alone when it has none).

    >>> first_line(KeyError("no such key"))
    "KeyError: 'no such key'"
    """
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def name_of(function: object) -> str:
    """How messages name a user's callable: `module.qualname` (`file.py:qualname` for a file
    that `--model file.py:make` or `--schedule file.py:Class` loaded), a partial's function, or
    the class of a callable object (a module: its forward).

    >>> import math
    >>> name_of(math.sqrt), name_of(lambda x: x)
    ('math.sqrt', 'schedcc.errors.<lambda>')
    """
    inner = getattr(function, "func", None)  # functools.partial
    if inner is not None and callable(inner):
        return name_of(inner)
    qualname = getattr(function, "__qualname__", None)
    if not isinstance(qualname, str):
        return type(function).__qualname__
    module = getattr(function, "__module__", None)
    if not isinstance(module, str):
        return qualname
    file = getattr(sys.modules.get(module), "__file__", None)
    if module.startswith(USER_FILE_MODULE) and isinstance(file, str):
        return f"{os.path.basename(file)}:{qualname}"
    return f"{module}.{qualname}"


#: The prefix of the module name `schedcc.registry` gives a user's file it loads.
USER_FILE_MODULE = "_schedcc_user_"
