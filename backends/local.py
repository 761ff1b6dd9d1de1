"""The local backend: every stage (and data-parallel replica) of a program in one process.

Stages exchange tensors through an in-memory mailbox keyed by the same route the validator pairs
sends and receives with (`schedcc.analysis.comm_route`). Each replica runs its stages round-robin,
advancing a stage until it reaches a receive whose send has not happened; a validated program
always finishes this way (a send never waits, which only relaxes the rendezvous model the
validator proves). Data-parallel replicas run as threads whose collectives meet at a barrier and
sum in rank order, so results are deterministic. With float64 this backend matches non-pipelined
training to ~1e-12: it is the oracle the distributed backend is tested against.

    >>> import torch, schedcc
    >>> from schedcc.backends.local import Engine
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4)))
    >>> program = schedcc.compile(schedcc.get_schedule("1f1b")(num_stages=2, num_microbatches=4))
    >>> engine = Engine(program, schedcc.partition(model, 2), torch.nn.functional.mse_loss,
    ...                 lambda params: torch.optim.SGD(params, lr=0.1))
    >>> loss = engine.train_step(torch.randn(8, 4), torch.randn(8, 4))
"""

from __future__ import annotations

import copy
import itertools
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from schedcc.backends.checkpoint.files import (
    load_stage_states,
    program_meta,
    shard_name,
    write_manifest,
    write_shard,
)
from schedcc.backends.checkpoint.state import rng_state, set_rng_state
from schedcc.backends.runtime.stage import StageRuntime
from schedcc.errors import DeadlockError, ScheduleConfigError
from schedcc.program import Program
from schedcc.semantics import Layout, comm_route
from schedcc.validate import validate

__all__ = ["Engine", "ThreadCollectives"]

#: Seconds a data-parallel replica waits for the others at a collective before giving up.
COLLECTIVE_TIMEOUT_S = 120.0

Batch = tuple[torch.Tensor, torch.Tensor]


class _Group:
    """The meeting point of one stage's data-parallel replicas (threads)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=COLLECTIVE_TIMEOUT_S)


class ThreadCollectives:
    """`Collectives` between replica threads of one process: sums in rank order (deterministic)."""

    def __init__(self, group: _Group, rank: int) -> None:
        self._group = group
        self.rank = rank
        self.size = group.size

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        group = self._group
        group.slots[self.rank] = tensor
        group.barrier.wait()
        seen = list(group.slots)  # type: ignore[arg-type]
        group.barrier.wait()  # nobody refills a slot before everyone has read them all
        return seen  # type: ignore[return-value]

    def _sum(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(tensor.detach().clone())
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        return total

    def all_reduce(self, tensor: torch.Tensor) -> None:
        tensor.copy_(self._sum(tensor))

    def reduce_scatter(self, flat: torch.Tensor) -> torch.Tensor:
        shard = flat.numel() // self.size
        return self._sum(flat)[self.rank * shard : (self.rank + 1) * shard].clone()

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(shard.detach().clone()))


class Engine:
    """Train `segments` with `program`, every stage in this process.

    Args:
        program: a compiled program; it is validated again here (a program that does not validate
            is refused with its `ScheduleError`).
        segments: the model cut into `p * v` modules, in model order (see `schedcc.partition`).
            They are trained in place. With `data_parallel > 1` they are replica 0; the other
            replicas are deep copies and hold the same weights after every step.
        loss_fn: `loss_fn(output, target)`, a scalar mean over the microbatch.
        optimizer: a callable from an iterable of parameters to a `torch.optim.Optimizer`.

    Raises:
        ScheduleConfigError: the number of segments is not `p * v`, or one is not a module.
        ScheduleError: the program does not validate.

    A batch is `(inputs, targets)`, split along dim 0 into `m` microbatches. With
    `data_parallel = dp > 1` a batch is either a sequence of `dp` local batches (one per
    replica, in data-parallel order) or one `(inputs, targets)` global batch that is split into
    `dp` equal local batches; a step equals non-pipelined training on their concatenation.
    """

    def __init__(
        self,
        program: Program,
        segments: Sequence[nn.Module],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer],
    ) -> None:
        if not isinstance(program, Program):
            raise ScheduleConfigError(
                f"Engine needs a compiled Program, got {type(program).__name__}: pass "
                "schedcc.compile(schedule)"
            )
        validate(program)
        schedule = program.schedule
        segments = list(segments)
        if len(segments) != schedule.num_segments:
            raise ScheduleConfigError(
                f"{schedule!r} needs p*v = {schedule.num_stages}*{schedule.num_chunks} = "
                f"{schedule.num_segments} segments, got {len(segments)}: cut the model with "
                f"schedcc.partition(model, {schedule.num_segments})"
            )
        for k, segment in enumerate(segments):
            if not isinstance(segment, nn.Module):
                raise ScheduleConfigError(
                    f"segment {k} is a {type(segment).__name__}, not a torch.nn.Module"
                )
        self.program = program
        self.segments = segments
        self._layout = Layout.of(schedule)
        dp = program.data_parallel
        replicas = [segments] + [copy.deepcopy(segments) for _ in range(dp - 1)]
        groups = [_Group(dp) for _ in range(schedule.num_stages)]
        self.runtimes: list[list[StageRuntime]] = [
            [
                StageRuntime(
                    program,
                    s,
                    [replica[k] for k in self._layout.segment[s]],
                    loss_fn,
                    optimizer,
                    collectives=ThreadCollectives(groups[s], r) if dp > 1 else None,
                )
                for s in range(schedule.num_stages)
            ]
            for r, replica in enumerate(replicas)
        ]
        self._groups = groups
        #: Optimizer steps taken so far (batches trained); saved in checkpoints.
        self.steps = 0

    # -- public ---------------------------------------------------------------------------------

    @property
    def peak_activation_bytes(self) -> list[int]:
        """Per stage (replica 0), the most bytes of saved activations held at once."""
        return [rt.peak_activation_bytes for rt in self.runtimes[0]]

    def train(self, batches: Iterable[Any]) -> Iterator[float]:
        """Train on `batches`, yielding each batch's loss (the global-batch mean).

        The program covers `num_batches` batches; the batches are taken in groups of that many
        and the program runs once per group. Each run starts from the current weights as version
        0, so under a weight-delayed schedule (2BW) the pipeline drains at group boundaries
        exactly as at the end of one program: the first `weight_delay` batches of every group use
        the group's starting weights.

        Raises:
            ScheduleConfigError: a bad batch (checked for a whole group before it runs), or fewer
                batches left than one program covers.
        """
        size = self.program.schedule.num_batches
        it = iter(batches)
        while group := list(itertools.islice(it, size)):
            if len(group) < size:
                raise ScheduleConfigError(
                    f"the program covers {size} batches per run but only {len(group)} were left: "
                    f"pass a multiple of {size} batches, or compile with num_batches=1"
                )
            for loss in self._run([self._split(b, j) for j, b in enumerate(group)]):
                self.steps += 1
                yield loss

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on one batch (flush schedules); returns its loss.

        Raises:
            ScheduleConfigError: the schedule delays weights or covers more than one batch (use
                `train`), or a bad batch.
        """
        schedule = self.program.schedule
        if schedule.weight_delay or schedule.num_batches != 1:
            raise ScheduleConfigError(
                f"train_step runs one flush step; {schedule!r} has weight_delay="
                f"{schedule.weight_delay} and num_batches={schedule.num_batches}: use train()"
            )
        (loss,) = self._run([self._split((inputs, targets), 0)])
        self.steps += 1
        return loss

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> Path:
        """Write a checkpoint of every stage and replica to the directory `path`.

        One file per (stage, data-parallel rank) and a manifest written last; see
        `schedcc.backends.checkpoint.files`. Returns the path of the manifest.
        """
        files = {}
        for r, runtimes in enumerate(self.runtimes):
            for s, runtime in enumerate(runtimes):
                state = runtime.state_dict()
                state["rng"] = rng_state()
                files[shard_name(s, r)] = write_shard(path, shard_name(s, r), state)
        return write_manifest(path, program_meta(self.program), self.steps, files)

    def load(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by `save` (or by the distributed backend).

        Everything is read and checked before anything changes: a checkpoint of another
        schedule or shape, or with a missing, truncated or altered file, raises
        `CheckpointError` and leaves the engine as it was. A different data-parallel degree or
        ZeRO setting is re-sharded.
        """
        stages = range(self.program.num_stages)
        manifest, states = load_stage_states(path, self.program, stages)
        for runtimes in self.runtimes:
            for s, runtime in enumerate(runtimes):
                runtime.check_state(states[s])
        for runtimes in self.runtimes:
            for s, runtime in enumerate(runtimes):
                runtime.load_state_dict(states[s])
        set_rng_state(states[0][0]["rng"])
        self.steps = manifest["step"]

    # -- batches --------------------------------------------------------------------------------

    def _split(self, batch: Any, index: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Per replica, the microbatches of inputs and targets; checks everything first."""
        dp = self.program.data_parallel
        if _is_pair(batch):
            inputs, targets = batch
            _check_pair(inputs, targets, index)
            if dp > 1:
                if inputs.shape[0] % dp:
                    raise ScheduleConfigError(
                        f"batch {index}: {inputs.shape[0]} samples cannot be split into "
                        f"data_parallel={dp} equal local batches"
                    )
                local = list(zip(inputs.chunk(dp), targets.chunk(dp)))
            else:
                local = [(inputs, targets)]
        elif isinstance(batch, Sequence) and len(batch) == dp and all(map(_is_pair, batch)):
            local = list(batch)
        else:
            raise ScheduleConfigError(
                f"batch {index} must be (inputs, targets) tensors"
                + (f" or a sequence of {dp} such local batches" if dp > 1 else "")
            )
        sizes = {x.shape[0] if isinstance(x, torch.Tensor) else None for x, _ in local}
        if len(sizes) > 1:
            raise ScheduleConfigError(
                f"batch {index}: the local batches hold {sorted(map(str, sizes))} samples; every "
                "data-parallel replica needs the same local batch size"
            )
        return [self._microbatches(x, y, index, r) for r, (x, y) in enumerate(local)]

    def _microbatches(self, inputs, targets, index: int, replica: int):
        _check_pair(inputs, targets, index)
        m = self.program.schedule.num_microbatches
        if inputs.shape[0] % m:
            raise ScheduleConfigError(
                f"batch {index} (replica {replica}): {inputs.shape[0]} samples cannot be split "
                f"into m={m} equal microbatches; make the batch size a multiple of {m}"
            )
        return list(inputs.chunk(m)), list(targets.chunk(m))

    # -- running --------------------------------------------------------------------------------

    def _run(self, batches) -> list[float]:
        """Run the program once over `batches` (per batch, per replica microbatches)."""
        first, last = self._layout.stage_of[0], self._layout.stage_of[-1]
        for r, runtimes in enumerate(self.runtimes):
            for s, rt in enumerate(runtimes):
                rt.reset()
                for b, local in enumerate(batches):
                    inputs, targets = local[r]
                    rt.load_batch(b, inputs if s == first else None, targets if s == last else None)
        if len(self.runtimes) == 1:
            self._run_replica(0)
        else:
            self._run_threads()
        return [
            sum(runtimes[last].losses[b] for runtimes in self.runtimes) / len(self.runtimes)
            for b in range(len(batches))
        ]

    def _run_threads(self) -> None:
        errors: list[BaseException] = []

        def body(r: int) -> None:
            try:
                self._run_replica(r)
            except BaseException as error:
                errors.append(error)
                for group in self._groups:
                    group.barrier.abort()  # wake the other replicas; they fail too

        threads = [threading.Thread(target=body, args=(r,)) for r in range(len(self.runtimes))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for group in self._groups:
            group.barrier.reset()
        if errors:
            broken = (threading.BrokenBarrierError,)
            raise next((e for e in errors if not isinstance(e, broken)), errors[0])

    def _run_replica(self, replica: int) -> None:
        runtimes = self.runtimes[replica]
        stages = self.program.stages
        cursor = [0] * len(stages)
        mailbox: dict[tuple, torch.Tensor] = {}
        while any(cursor[s] < len(ops) for s, ops in enumerate(stages)):
            progressed = False
            for s, ops in enumerate(stages):
                start = cursor[s]
                cursor[s] = self._advance(runtimes[s], s, ops, start, mailbox)
                progressed |= cursor[s] != start
            if not progressed:
                waiting = {
                    s: str(stages[s][cursor[s]])
                    for s in range(len(stages))
                    if cursor[s] < len(stages[s])
                }
                raise DeadlockError(f"local backend: every stage waits on a receive: {waiting}")

    def _advance(self, runtime: StageRuntime, s: int, ops, pos: int, mailbox) -> int:
        """Run stage s from `pos` until it ends or waits on a receive; the new position."""
        while pos < len(ops):
            op = ops[pos]
            if op.group == "comm":
                route = comm_route(self._layout, s, op)
                if route is None:
                    raise DeadlockError(f"local backend: stage {s} {op} has no peer", stage=s)
                if op.is_send:
                    mailbox[route] = runtime.outgoing(op).clone()  # what a network would do
                elif route in mailbox:
                    runtime.incoming(op, mailbox.pop(route))
                else:
                    return pos
            else:
                runtime.run(op)
            pos += 1
        return pos


def _is_pair(batch: Any) -> bool:
    return (
        isinstance(batch, (tuple, list))
        and len(batch) == 2
        and all(isinstance(t, torch.Tensor) for t in batch)
    )


def _check_pair(inputs: Any, targets: Any, index: int) -> None:
    for name, t in (("inputs", inputs), ("targets", targets)):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise ScheduleConfigError(
                f"batch {index}: {name} must be a tensor with a batch dimension, got "
                f"{type(t).__name__}{'' if not isinstance(t, torch.Tensor) else ' scalar'}"
            )
    if inputs.shape[0] != targets.shape[0]:
        raise ScheduleConfigError(
            f"batch {index}: inputs hold {inputs.shape[0]} samples but targets hold "
            f"{targets.shape[0]}: targets must have the same batch size (dim 0)"
        )
