"""The contract both engines keep: `BaseEngine`.

`schedcc.backends.local.Engine` (every stage in one process) and
`schedcc.backends.distributed.Engine` (one stage per rank) differ only in where the stages run and
how tensors travel between them. What a user sees is written here once, so the two cannot drift:

- the arguments are checked alike (a compiled, valid program; `p * v` modules, or on the
  distributed engine this stage's `v`, or a builder `build(k) -> nn.Module` called for the
  segments the engine holds; callables for `loss_fn`, `optimizer` and `lr_scheduler`, whose
  scheduler steps with each stage's optimizer);
- a batch is checked and split alike, and every bad batch is a `ScheduleConfigError` naming it,
  raised before anything runs;
- `train(batches)` takes batches `num_batches` at a time (one run of the program each) and
  `train_step(inputs, targets)` runs one flush step; `steps` counts optimizer steps taken;
  `last_metrics` holds the named parts of the last batch's loss; both take `on_step`, called
  with one record per optimizer step on the one process that writes metrics
  (`backends.metrics`), and `read_loss`: False leaves each loss on the device, a 0-dim
  float64 tensor, and reads nothing on the host ([Note: an unread loss is a tensor] in
  `backends.runtime.loss_values`);
- `evaluate(inputs, targets)` and `predict(inputs)` run a forward-only program
  (`schedcc.compile(..., forward_only=True)`) with the segments in eval mode, under a copy of
  the RNG state, and change no parameter, gradient, optimizer or RNG state;
- `save(path) -> Path` (the manifest) and `load(path)` (into any shape, by parameter name);
  `state_dict()`, the whole model's; `peak_activation_bytes` per stage, `microbatch_bytes`
  per segment;
- `register_handler(kind, fn)` runs an instruction kind with the user's code
  (`backends.runtime.handlers`).

An engine supplies `_prepare` (check and split one run's batches, raising before anything runs),
`_run` (run the program once, returning each batch's loss and named parts, read or on the
device), `_forward_run` (the
forward-only program on one batch), `_runtimes` (the stage runtimes it holds), `_held_modules`,
`_model_state`, `save` and `load`. Batches are checked and split by `backends.batches`.
"""

from __future__ import annotations

import abc
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from schedcc.backends.batches import check_sizes, is_pair
from schedcc.backends.checkpoint.model import model_names
from schedcc.backends.metrics import OnStep, step_records
from schedcc.backends.runtime.handlers import check_handler
from schedcc.backends.runtime.precision import LOW_PRECISION
from schedcc.errors import ScheduleConfigError, first_line
from schedcc.ir import GradNorm
from schedcc.program import Program
from schedcc.validate import validate

if TYPE_CHECKING:
    from schedcc.backends.runtime.stage import StageRuntime
    from schedcc.schedule import Schedule

__all__ = [
    "BaseEngine",
    "LRSchedulerFactory",
    "LossFn",
    "OptimizerFactory",
    "SegmentBuilder",
    "build_segments",
    "check_precision",
    "check_segments",
    "copied_state",
    "is_builder",
    "is_pair",
]

#: `loss_fn(output, targets)`: a scalar mean over the microbatch, a `(loss_sum, count)` pair or a
#: dict of named scalars (`backends.runtime.losses`).
LossFn = Callable[[Any, Any], Any]
#: A callable from an iterable of parameters to a `torch.optim.Optimizer`.
OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]
#: A callable from an optimizer to a `torch.optim.lr_scheduler.LRScheduler` over it.
LRSchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
#: `build(k) -> nn.Module`: segment k of the model (`0 <= k < p*v`), called only for the
#: segments an engine holds (see `build_segments`).
SegmentBuilder = Callable[[int], nn.Module]


class BaseEngine(abc.ABC):
    """What every engine does the same way (see the module docstring).

    Args:
        program: a compiled program; it is validated again here.
        loss_fn: `loss_fn(output, target)`, a scalar mean over the microbatch.
        optimizer: a callable from an iterable of parameters to a `torch.optim.Optimizer`.
        lr_scheduler: None, or a callable from an optimizer to a
            `torch.optim.lr_scheduler.LRScheduler` over it: each stage's optimizer (under ZeRO
            each rank's shard optimizer) gets its own, stepped after every optimizer step that
            is not skipped, and saved in checkpoints.

    Raises:
        ScheduleConfigError: `program` is not a `Program`, or `loss_fn`, `optimizer` or
            `lr_scheduler` is not callable (e.g. an optimizer or scheduler instance instead of
            a factory).
        ScheduleError: the program does not validate.
    """

    def __init__(
        self,
        program: Program,
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        lr_scheduler: LRSchedulerFactory | None = None,
    ) -> None:
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
        scheduler = torch.optim.lr_scheduler.LRScheduler
        if lr_scheduler is not None and (
            isinstance(lr_scheduler, scheduler) or not callable(lr_scheduler)
        ):
            raise ScheduleConfigError(
                f"lr_scheduler must be None or a callable from an optimizer to a "
                f"torch.optim.lr_scheduler.LRScheduler, got {type(lr_scheduler).__name__}: pass "
                "e.g. lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=100); "
                "each stage builds its own over its optimizer"
            )
        self.program = program
        #: Optimizer steps taken so far (batches trained); saved in checkpoints.
        self.steps = 0
        #: The named parts of the last batch's loss that `train` yielded (a dict loss's parts,
        #: else `{"loss": ...}`); on the distributed engine, every part only on the last stage.
        #: Floats, or 0-dim device tensors after a run with `read_loss=False`.
        self.last_metrics: dict[str, float | torch.Tensor] = {}
        self._forward_only: Program | None = None

    # -- training -------------------------------------------------------------------------------

    def train(
        self,
        batches: Iterable[Any],
        *,
        on_step: OnStep | None = None,
        microbatch_sizes: Iterable[Sequence[int]] | None = None,
        read_loss: bool = True,
    ) -> Iterator[float | torch.Tensor]:
        """Train on `batches`, yielding each batch's loss.

        The program covers `num_batches` optimizer steps; the batches are taken that many at a
        time, checked, and the program runs once per group. Each run starts from the current
        weights as version 0, so a weight-delayed schedule (2BW) drains at group boundaries
        exactly as at the end of one program.

        Args:
            batches: `(inputs, targets)` pairs, one per optimizer step.
            on_step: None, or called after each run with each of its steps' records (in
                order, before their losses are yielded) where `writes_metrics`: e.g. a
                `backends.metrics.JsonlWriter` (see `backends.metrics.step_records`).
            microbatch_sizes: None (equal microbatches), or one list of `m` sizes per batch,
                taken alongside them (as `train_step`'s).
            read_loss: True (the default): each loss is a float, read on the host once per
                run. False: each is a 0-dim float64 tensor on the device, equal to that float,
                and a step reads nothing for it ([Note: an unread loss is a tensor] in
                `backends.runtime.loss_values`; `.item()` it when you need the number).

        Raises:
            ScheduleConfigError: a bad batch (a whole group is checked before it runs), fewer
                batches left than one program covers, bad or missing sizes for a batch, or
                `read_loss` that is not a bool or is False with an `on_step` (a record holds
                the loss as a number).

        >>> # losses = list(engine.train(batches, read_loss=False))  # no sync per step
        >>> # print(torch.stack(losses).mean().item())  # one read, when you choose
        """
        read = _reading(read_loss, on_step)
        m, per_run = self.program.schedule.num_microbatches, self.program.schedule.num_batches
        stream = iter(batches)
        sizes = iter(microbatch_sizes) if microbatch_sizes is not None else None
        first = 0
        while group := list(islice(stream, per_run)):
            if len(group) < per_run:
                raise ScheduleConfigError(
                    f"the program covers {per_run} batches per run but only {len(group)} were "
                    f"left: pass a multiple of {per_run} batches, or compile with num_batches=1"
                )
            given = None
            if sizes is not None:
                given = [next(sizes, None) for _ in group]
                if any(n is None for n in given):
                    raise ScheduleConfigError(
                        f"microbatch_sizes ran out at batch {first + given.index(None)}: give "
                        "one list of sizes per batch"
                    )
                given = [check_sizes(n, m, where=f"batch {first + j}: microbatch_sizes")
                         for j, n in enumerate(given)]  # fmt: skip
            prepared = self._prepare(group, first, given)
            watch = self._watch(on_step)
            losses = self._run(prepared, read=read)
            first += per_run
            self.steps += per_run  # the run took them all, whether or not each loss is read
            self._report(on_step, watch, losses)
            for loss, parts in losses:
                self.last_metrics = parts
                yield loss

    def train_step(
        self,
        inputs: Any,
        targets: Any,
        *,
        microbatch_sizes: Sequence[int] | None = None,
        on_step: OnStep | None = None,
        read_loss: bool = True,
    ) -> float | torch.Tensor:
        """One optimizer step on one batch, for flush schedules; returns its loss.

        `microbatch_sizes`, if given, are the samples of each of the `m` microbatches (a local
        batch's, alike on every data-parallel replica and every rank), in order: microbatches
        of unequal size ([Note: unequal microbatches] in `backends.runtime.losses`; see
        `schedcc.microbatches.balance`). `on_step`, if given, is called with the step's
        record, as `train`'s. `read_loss=False` returns the loss as a 0-dim float64 tensor on
        the device and reads nothing for it, as `train`'s.

        Raises:
            ScheduleConfigError: the program covers more than one batch or delays weights (a
                delay acts across the batches of one run: use `train`), a bad batch,
                `microbatch_sizes` that are not `m` positive ints summing to the batch size, or
                `read_loss` as `train` refuses it.

        >>> # engine.train_step(x[:12], y[:12], microbatch_sizes=[1, 3, 2, 6])
        """
        read = _reading(read_loss, on_step)
        schedule = self.program.schedule
        if schedule.weight_delay or schedule.num_batches != 1:
            raise ScheduleConfigError(
                f"train_step runs one flush step; {schedule!r} has weight_delay="
                f"{schedule.weight_delay} and num_batches={schedule.num_batches}: use "
                "train(batches), which runs the program once per num_batches batches"
            )
        sizes = None
        if microbatch_sizes is not None:
            sizes = [check_sizes(microbatch_sizes, schedule.num_microbatches)]
        prepared = self._prepare([(inputs, targets)], 0, sizes)
        watch = self._watch(on_step)
        ((loss, parts),) = losses = self._run(prepared, read=read)
        self.steps += 1
        self._report(on_step, watch, losses)
        self.last_metrics = parts
        return loss

    @property
    def writes_metrics(self) -> bool:
        """Whether this process calls `on_step`: the local engine does; of the distributed
        engine's ranks, only global rank 0."""
        return True

    def _watch(self, on_step: OnStep | None) -> tuple[float, float | None] | None:
        """Before a run: `(its start time, the learning rate it starts at)` where `on_step`
        is to be called, else None."""
        if on_step is None or not self.writes_metrics:
            return None
        return time.perf_counter(), self._learning_rate()

    def _report(
        self, on_step: OnStep | None, watch: tuple[float, float | None] | None, losses: list
    ) -> None:
        """After a run (counted in `steps`): its steps' records to `on_step`, if `watch`ed
        ([Note: metrics without host syncs] in `backends.metrics`)."""
        if watch is None or on_step is None:
            return
        start, lr = watch
        records = step_records(
            losses,
            first_step=self.steps - len(losses),
            seconds=time.perf_counter() - start,
            lr=lr,
            grad_norm=self.last_grad_norm,
            loss_scale=self.loss_scale,
            skipped_steps=self.skipped_steps,
        )
        for record in records:
            on_step(record)

    def _learning_rate(self) -> float | None:
        """`param_groups[0]["lr"]` of the first held optimizer (a stage without trained
        parameters has none); None where none is held."""
        for runtime in self._runtimes():
            if runtime.optimizer is not None:
                return float(runtime.optimizer.param_groups[0]["lr"])
        return None

    # -- the user's handlers --------------------------------------------------------------------

    def register_handler(self, kind: type, fn: Callable[[Any], Any]) -> None:
        """Run every instruction of `kind` through `fn(call)`, on every stage this engine
        holds (on the distributed engine, each rank registers its own).

        `kind` is a compute instruction class (`backends.runtime.handlers.HANDLED`). `fn` gets
        an `InstructionCall` (`stage`, `instruction`, `modules`, `device`) and runs the
        built-in work with `call.run()`, once; for `OverlappedBackward` an `OverlappedPair`
        whose `run_forward()` and `run_backward()` it calls once each, in either order or at
        once, replacing the default (two CUDA streams; in order on the CPU). See [Note:
        custom handlers] and [Note: running an overlapped pair] in
        `backends.runtime.handlers`.

        Raises:
            ScheduleConfigError: `kind` is not a compute instruction class, or `fn` is not
                callable. A handler that raises, or returns without running its work, is a
                `RuntimeInstructionError` naming the instruction when it runs.

        >>> # def pair(call):  # e.g. time each half, or overlap a MoE all-to-all
        >>> #     call.run_backward(); call.run_forward()
        >>> # engine.register_handler(schedcc.OverlappedBackward, pair)
        """
        check_handler(kind, fn)
        for runtime in self._all_runtimes():
            runtime.register_handler(kind, fn)

    # -- evaluation -----------------------------------------------------------------------------

    def evaluate(self, inputs: Any, targets: Any) -> float:
        """The loss of one batch under the current weights, without training.

        A forward-only program (`schedcc.compile(schedule, forward_only=True)`) runs the batch
        through the pipeline, split into `num_batches * m` microbatches, with every segment in
        eval mode (restored after) and under a copy of the RNG state; no parameter, gradient,
        optimizer or RNG state changes. The loss is what `train` would report: the mean of the
        microbatch losses, or the total sum over the total count for a `(loss_sum, count)` loss
        (over the data-parallel replicas too).

        Raises:
            ScheduleConfigError: a bad batch, as for `train`.
        """
        with self._evaluating():
            loss, _ = self._forward_run(inputs, targets)
        return loss  # type: ignore[return-value]

    def predict(self, inputs: Any) -> Any:
        """The last segment's outputs for one batch of `inputs`, joined along dim 0
        (`backends.runtime.values.concat`), computed as `evaluate` computes the loss.

        On the distributed engine, the outputs of this rank's local batch, returned on the
        last stage's ranks; None on the others.
        """
        with self._evaluating():
            _, outputs = self._forward_run(inputs, None)
        return outputs

    @property
    def forward_only_program(self) -> Program:
        """The forward-only program `evaluate` and `predict` run, compiled on first use."""
        if self._forward_only is None:
            from schedcc.compiler import compile

            self._forward_only = compile(
                self.program.schedule,
                data_parallel=self.program.data_parallel,
                zero=self.program.zero,
                forward_only=True,
            )
        return self._forward_only

    @contextmanager
    def _evaluating(self) -> Iterator[None]:
        """Every held module in eval mode, and the RNG state put back, for the duration."""
        modules = [sub for module in self._held_modules() for sub in module.modules()]
        flags = [sub.training for sub in modules]
        devices = sorted(
            {
                p.device.index or 0
                for m in modules
                for p in m.parameters(recurse=False)
                if p.device.type == "cuda"
            }
        )
        with torch.random.fork_rng(devices=devices):
            for sub in modules:
                sub.training = False
            try:
                yield
            finally:
                for sub, flag in zip(modules, flags):
                    sub.training = flag

    @property
    def last_grad_norm(self) -> float | None:
        """The whole model's gradient norm (before clipping) at the last step: what
        `torch.nn.utils.clip_grad_norm_` returns on the non-pipelined model; None before the
        first step or for a program without `GradNorm` (`compile(..., grad_norm=True)`)."""
        return self._runtimes()[0].norm.last

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because some gradient was inf or NaN (on any stage or replica): every
        rank skipped them alike, leaving weights and optimizer state unchanged. Needs a program
        with `GradNorm`; without one, no step is ever skipped."""
        return self._runtimes()[0].state.skipped_steps

    @property
    def loss_scale(self) -> float | None:
        """The dynamic loss scale under `mixed_precision=torch.float16`, else None."""
        scaler = self._runtimes()[0].norm.scaler
        return scaler.scale if scaler is not None else None

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

    @property
    def microbatch_bytes(self) -> dict[int, dict[str, int]]:
        """Per segment this engine ran a forward of (on the distributed engine, its stage's),
        the most one microbatch's forward saved and its input took (its first data-parallel
        replica; `StageRuntime.microbatch_bytes`: what `schedcc run --trace` records)."""
        return {k: v for runtime in self._runtimes() for k, v in runtime.microbatch_bytes.items()}

    @contextmanager
    def unsharded(self) -> Iterator[None]:
        """Under ZeRO-3, the held segments' parameters whole for the duration; a no-op otherwise.

        Between runs a ZeRO-3 engine's modules hold no parameter data (each rank keeps only its
        shard of each chunk); inside this block they hold the current weights, to read or
        export. What is written to them there is not kept. On the distributed engine every rank
        enters it (an all-gather over each stage's data-parallel group).

        >>> # with engine.unsharded():
        >>> #     torch.save(segments[0].state_dict(), "segment0.pt")
        """
        if self.program.zero != 3:
            yield
            return
        self._unshard_all()
        try:
            yield
        finally:
            for runtime in self._all_runtimes():
                runtime.state.release_all()

    def state_dict(self, *, everywhere: bool = True) -> dict[str, Any] | None:
        """The whole model's state dict: every segment's parameters and buffers, whole (ZeRO-3
        shards joined) and on the CPU, under model-wide names (`checkpoint.model.model_names`):
        the names of the unsplit model where the segments keep the model's own module names (as
        `schedcc.partition` and `schedcc.split` cut it), else `segment<k>.<key>`. A tied
        parameter appears under each of its names.

        On the distributed engine every rank calls it (it gathers every stage's segments); with
        `everywhere=False` only rank 0 gets the dict and the others None.

        >>> # model.load_state_dict(engine.state_dict())  # the unsplit model, trained
        """
        states = self._model_state(everywhere)
        if states is None:
            return None
        names = model_names({k: list(state) for k, state in states.items()})
        return {names[k][key]: value for k in sorted(states) for key, value in states[k].items()}

    # -- what each engine supplies -------------------------------------------------------------

    @abc.abstractmethod
    def _model_state(self, everywhere: bool) -> dict[int, dict[str, Any]] | None:
        """Per segment of the model, its state dict whole on the CPU (`copied_state`); None on a
        rank that is not to get it (`state_dict`)."""

    @abc.abstractmethod
    def save(self, path: str | os.PathLike) -> Path:
        """Write a checkpoint to the directory `path`; returns the path of its manifest."""

    @abc.abstractmethod
    def load(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by either engine's `save` (its directory, or the
        manifest path `save` returned), or raise `CheckpointError` and change nothing."""

    @abc.abstractmethod
    def _prepare(
        self, group: list[Any], first: int, sizes: list[tuple[int, ...]] | None = None
    ) -> Any:
        """Check and split the batches of one run (`first` is the first one's index, for
        messages; `sizes`: per batch, its microbatches' sizes, None for equal ones); raise
        `ScheduleConfigError` before anything runs."""

    @abc.abstractmethod
    def _run(self, prepared: Any, *, read: bool = True) -> list[tuple[Any, dict[str, Any]]]:
        """Run the program once on what `_prepare` returned; each batch's loss and parts: floats
        (`read`: one host read), else 0-dim device tensors and no read
        (`backends.runtime.loss_values`); a run that reads nothing ends as [Note: one run
        ahead] in `backends.runtime.syncs` says."""

    @abc.abstractmethod
    def _forward_run(self, inputs: Any, targets: Any) -> tuple[float | None, Any]:
        """Run `forward_only_program` on one batch (no targets: None); `(loss, outputs)`."""

    @abc.abstractmethod
    def _held_modules(self) -> list[nn.Module]:
        """Every segment module this engine holds (all its replicas')."""

    @abc.abstractmethod
    def _runtimes(self) -> list[StageRuntime]:
        """The stage runtimes this engine holds (its first data-parallel replica's)."""

    def _all_runtimes(self) -> list[StageRuntime]:
        """Every stage runtime this engine holds, of every replica."""
        return self._runtimes()

    def _unshard_all(self) -> None:
        """ZeRO-3: make every held runtime's parameters whole (`unsharded`)."""
        for runtime in self._all_runtimes():
            runtime.state.unshard_all()


# -- arguments ----------------------------------------------------------------------------------


def _reading(read_loss: object, on_step: OnStep | None) -> bool:
    """`read_loss`, checked against `on_step`.

    Raises:
        ScheduleConfigError: not a bool, or False with an `on_step`.
    """
    if not isinstance(read_loss, bool):
        raise ScheduleConfigError(
            f"read_loss must be True (losses as floats) or False (0-dim device tensors, no host "
            f"read), got {read_loss!r}"
        )
    if not read_loss and on_step is not None:
        raise ScheduleConfigError(
            "on_step writes each step's loss as a number, which reads it on the host every "
            "step, and read_loss=False asks for no read: drop one of them (or keep "
            "read_loss=False and write your own record from loss.item() every N steps)"
        )
    return read_loss


def check_precision(
    program: Program, max_grad_norm: float | None, mixed_precision: torch.dtype | None
) -> None:
    """Refuse `max_grad_norm` and `mixed_precision` values an engine cannot honour.

    Raises:
        ScheduleConfigError: `max_grad_norm` is not a positive number, `mixed_precision` is not
            None, `torch.bfloat16`, `torch.float16` or `torch.float32`, or clipping or float16
            is asked of a program without `GradNorm` (compile it with `grad_norm=True`).
    """
    has_norm = any(type(op) is GradNorm for ops in program.stages for op in ops)
    if max_grad_norm is not None:
        bad = isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
        if bad or not 0 < max_grad_norm < math.inf:
            raise ScheduleConfigError(
                f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}"
            )
        if not has_norm:
            raise ScheduleConfigError(
                "max_grad_norm clips by the whole model's gradient norm, a collective over every "
                "stage that this program lacks: compile with schedcc.compile(..., "
                "grad_norm=True)"
            )
    if mixed_precision not in (None, torch.float32, *LOW_PRECISION):
        raise ScheduleConfigError(
            f"mixed_precision must be None, torch.bfloat16 or torch.float16, got "
            f"{mixed_precision!r}"
        )
    if mixed_precision == torch.float16 and not has_norm:
        raise ScheduleConfigError(
            "mixed_precision=torch.float16 scales the loss and skips the steps that overflow, "
            "which needs the all-stage gradient norm: compile with schedcc.compile(..., "
            "grad_norm=True) (or use torch.bfloat16, which needs no loss scaling)"
        )


def check_segments(
    schedule: Schedule, segments: Sequence[nn.Module], *, own_stage: bool = False
) -> list[nn.Module]:
    """`segments` as a list: the `p * v` modules of the model in order (or, with `own_stage`,
    also just one stage's `v`, by chunk). A builder is `build_segments`' (see `is_builder`).

    Raises:
        ScheduleConfigError: another count, or an item that is not a `torch.nn.Module`.
    """
    try:
        segments = list(segments)
    except TypeError:
        raise ScheduleConfigError(
            f"segments must be a sequence of modules or a builder build(k) -> nn.Module, got a "
            f"{type(segments).__name__}: cut the model with schedcc.partition(model, "
            f"{schedule.num_segments})"
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


def copied_state(state: dict[str, Any]) -> dict[str, Any]:
    """A module state dict's tensors detached and copied to the CPU (the rest as they are)."""
    return {
        key: value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
        for key, value in state.items()
    }


def is_builder(segments: object) -> bool:
    """Whether `segments` is a `SegmentBuilder` rather than a sequence of modules (a module is
    callable too, and an `nn.Sequential` iterates over its layers: neither is a builder)."""
    return callable(segments) and not isinstance(segments, (nn.Module, Sequence))


def build_segments(
    schedule: Schedule, build: SegmentBuilder, segments: Sequence[int]
) -> dict[int, nn.Module]:
    """`{k: build(j)}` for each of `segments`, where `j` is `k`'s segment of the model.

    [Note: building only what a rank holds] An engine given a builder calls it only for the
    segments it holds: the local engine for all `p*v`, a distributed rank for its stage's `v`;
    so a rank allocates only its own parameters, as DeepSpeed's `LayerSpec` and
    torch.distributed.pipelining's per-stage models do. Segments built apart share no
    `Parameter` object, so a tie (an LM head tied to the embedding) is declared with
    `schedcc.compile(..., tied=...)` and found by value: the copies must start equal, so the
    builder seeds each parameter the same way whichever segments it builds ([Note: ties across
    ranks] in `backends.distributed.ties`). Under a schedule with model replicas (DualPipe),
    segment `r*L + j` is a copy of segment `j` (`L = p*v / R`): `build(j)` is called once and
    the module held for both, as when the caller passes the same module twice.

    Raises:
        ScheduleConfigError: `build(j)` raised (its first line) or returned something that is
            not a `torch.nn.Module`; both name the segment.
    """
    length = schedule.num_segments // type(schedule).num_replicas
    made: dict[int, nn.Module] = {}
    for k in segments:
        j = k % length
        if j in made:
            continue
        try:
            module = build(j)
        except Exception as exc:  # the user's code may fail in any way: one line saying how
            detail = first_line(exc)
            raise ScheduleConfigError(
                f"segments: build({j}) raised {detail}; the builder must return segment {j} "
                "of the model as a torch.nn.Module"
            ) from exc
        if not isinstance(module, nn.Module):
            raise ScheduleConfigError(
                f"segments: build({j}) returned a {type(module).__name__}, not a "
                f"torch.nn.Module: the builder must return segment {j} of the model"
            )
        made[j] = module
    return {k: made[k % length] for k in segments}
