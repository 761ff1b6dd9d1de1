"""The contract both engines keep: `BaseEngine`.

`schedcc.backends.local.Engine` (every stage in one process) and
`schedcc.backends.distributed.Engine` (one stage per rank) differ only in where the stages run and
how tensors travel between them. What a user sees is written here once, so the two cannot drift:

- the arguments are checked alike (a compiled, valid program; `p * v` modules, or on the
  distributed engine this stage's `v`; callables for `loss_fn` and `optimizer`);
- a batch is checked and split alike, and every bad batch is a `ScheduleConfigError` naming it,
  raised before anything runs;
- `train(batches)` takes batches `num_batches` at a time (one run of the program each) and
  `train_step(inputs, targets)` runs one flush step; `steps` counts optimizer steps taken;
- `save(path) -> Path` (the manifest) and `load(path)`; `peak_activation_bytes` per stage.

An engine supplies `_prepare` (check and split one run's batches, raising before anything runs),
`_run` (run the program once, returning each batch's loss), `_runtimes` (the stage runtimes it
holds), `save` and `load`.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from schedcc.errors import ScheduleConfigError
from schedcc.program import Program
from schedcc.validate import validate

if TYPE_CHECKING:
    from schedcc.backends.runtime.stage import StageRuntime
    from schedcc.schedule import Schedule

__all__ = ["BaseEngine", "LossFn", "OptimizerFactory", "check_pair", "check_segments", "is_pair"]

#: `loss_fn(output, target) -> scalar`, a mean over the microbatch.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: A callable from an iterable of parameters to a `torch.optim.Optimizer`.
OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


class BaseEngine(abc.ABC):
    """What every engine does the same way (see the module docstring).

    Args:
        program: a compiled program; it is validated again here.
        loss_fn: `loss_fn(output, target)`, a scalar mean over the microbatch.
        optimizer: a callable from an iterable of parameters to a `torch.optim.Optimizer`.

    Raises:
        ScheduleConfigError: `program` is not a `Program`, or `loss_fn` or `optimizer` is not
            callable (e.g. an optimizer instance instead of a factory).
        ScheduleError: the program does not validate.
    """

    def __init__(self, program: Program, loss_fn: LossFn, optimizer: OptimizerFactory) -> None:
        if not isinstance(program, Program):
            raise ScheduleConfigError(
                f"Engine needs a compiled Program, got {type(program).__name__}: pass "
                "schedcc.compile(schedule)"
            )
        validate(program)  # a program that does not validate could hang or train wrongly
        if not callable(loss_fn):
            raise ScheduleConfigError(
                f"loss_fn must be a callable loss_fn(output, target) -> scalar, got "
                f"{type(loss_fn).__name__}"
            )
        if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
            raise ScheduleConfigError(
                f"optimizer must be a callable from parameters to a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}: pass e.g. lambda params: torch.optim.SGD(params, "
                "lr=0.1); each stage builds its own over the parameters it holds"
            )
        self.program = program
        #: Optimizer steps taken so far (batches trained); saved in checkpoints.
        self.steps = 0

    # -- training -------------------------------------------------------------------------------

    def train(self, batches: Iterable[Any]) -> Iterator[float]:
        """Train on `batches`, yielding each batch's loss.

        The program covers `num_batches` optimizer steps; the batches are taken that many at a
        time, checked, and the program runs once per group. Each run starts from the current
        weights as version 0, so a weight-delayed schedule (2BW) drains at group boundaries
        exactly as at the end of one program.

        Raises:
            ScheduleConfigError: a bad batch (a whole group is checked before it runs), or fewer
                batches left than one program covers.
        """
        per_run = self.program.schedule.num_batches
        stream = iter(batches)
        first = 0
        while group := list(islice(stream, per_run)):
            if len(group) < per_run:
                raise ScheduleConfigError(
                    f"the program covers {per_run} batches per run but only {len(group)} were "
                    f"left: pass a multiple of {per_run} batches, or compile with num_batches=1"
                )
            losses = self._run(self._prepare(group, first))
            first += per_run
            self.steps += per_run  # the run took them all, whether or not each loss is read
            yield from losses

    def train_step(self, inputs: Any, targets: Any) -> float:
        """One optimizer step on one batch, for flush schedules; returns its loss.

        Raises:
            ScheduleConfigError: the program covers more than one batch or delays weights (a
                delay acts across the batches of one run: use `train`), or a bad batch.
        """
        schedule = self.program.schedule
        if schedule.weight_delay or schedule.num_batches != 1:
            raise ScheduleConfigError(
                f"train_step runs one flush step; {schedule!r} has weight_delay="
                f"{schedule.weight_delay} and num_batches={schedule.num_batches}: use "
                "train(batches), which runs the program once per num_batches batches"
            )
        (loss,) = self._run(self._prepare([(inputs, targets)], 0))
        self.steps += 1
        return loss

    @property
    def peak_activation_bytes(self) -> list[int | None]:
        """Per stage of the program, the most bytes of saved activations it held at once (its
        first data-parallel replica); None for a stage this engine does not run (on the
        distributed engine, every stage but its own)."""
        held = {runtime.stage: runtime for runtime in self._runtimes()}
        return [
            held[s].peak_activation_bytes if s in held else None
            for s in range(self.program.num_stages)
        ]

    # -- what each engine supplies -------------------------------------------------------------

    @abc.abstractmethod
    def save(self, path: str | os.PathLike) -> Path:
        """Write a checkpoint to the directory `path`; returns the path of its manifest."""

    @abc.abstractmethod
    def load(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by either engine's `save`, or raise `CheckpointError`
        and change nothing."""

    @abc.abstractmethod
    def _prepare(self, group: list[Any], first: int) -> Any:
        """Check and split the batches of one run (`first` is the first one's index, for
        messages); raise `ScheduleConfigError` before anything runs."""

    @abc.abstractmethod
    def _run(self, prepared: Any) -> list[float]:
        """Run the program once on what `_prepare` returned; each batch's loss."""

    @abc.abstractmethod
    def _runtimes(self) -> list[StageRuntime]:
        """The stage runtimes this engine holds (its first data-parallel replica's)."""


# -- arguments ----------------------------------------------------------------------------------


def check_segments(
    schedule: Schedule, segments: Sequence[nn.Module], *, own_stage: bool = False
) -> list[nn.Module]:
    """`segments` as a list: the `p * v` modules of the model in order (or, with `own_stage`,
    also just one stage's `v`, by chunk).

    Raises:
        ScheduleConfigError: another count, or an item that is not a `torch.nn.Module`.
    """
    try:
        segments = list(segments)
    except TypeError:
        raise ScheduleConfigError(
            f"segments must be a sequence of modules, got a {type(segments).__name__}: cut the "
            f"model with schedcc.partition(model, {schedule.num_segments})"
        ) from None
    n, v = schedule.num_segments, schedule.num_chunks
    if len(segments) != n and not (own_stage and len(segments) == v):
        alternative = f", or this stage's {v} by chunk" if own_stage else ""
        raise ScheduleConfigError(
            f"{schedule!r} needs p*v = {schedule.num_stages}*{v} = {n} segments{alternative}, "
            f"got {len(segments)}: cut the model with schedcc.partition(model, {n})"
        )
    for k, segment in enumerate(segments):
        if not isinstance(segment, nn.Module):
            raise ScheduleConfigError(
                f"segment {k} is a {type(segment).__name__}, not a torch.nn.Module"
            )
    return segments


# -- batches ------------------------------------------------------------------------------------


def is_pair(batch: Any) -> bool:
    """Whether `batch` is one `(inputs, targets)` pair of tensors."""
    return (
        isinstance(batch, (tuple, list))
        and len(batch) == 2
        and all(isinstance(t, torch.Tensor) for t in batch)
    )


def check_pair(
    inputs: Any, targets: Any, index: int, m: int | None = None, *, where: str = ""
) -> None:
    """Raise `ScheduleConfigError` unless `inputs` and `targets` are tensors with a batch
    dimension of the same size, and that size is a multiple of `m` (when given). The message
    names batch `index`, followed by `where` (e.g. " (replica 1)")."""
    for name, t in (("inputs", inputs), ("targets", targets)):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise ScheduleConfigError(
                f"batch {index}{where}: {name} must be a tensor with a batch dimension, got "
                f"{type(t).__name__}{'' if not isinstance(t, torch.Tensor) else ' scalar'}"
            )
    if inputs.shape[0] != targets.shape[0]:
        raise ScheduleConfigError(
            f"batch {index}{where}: inputs hold {inputs.shape[0]} samples but targets hold "
            f"{targets.shape[0]}: targets must have the same batch size (dim 0)"
        )
    if m is not None and inputs.shape[0] % m:
        raise ScheduleConfigError(
            f"batch {index}{where}: {inputs.shape[0]} samples cannot be split into m={m} equal "
            f"microbatches; make the batch size a multiple of {m}"
        )
