"""The `torch.distributed` backend: one process per (data-parallel rank, stage).

`Engine` runs one stage's program on its rank: compute and update instructions go to the shared
`StageRuntime`. Under NCCL each comm group is posted whole, as ONE
`torch.distributed.batch_isend_irecv`, and its receives are waited before the next instruction (the
execution semantics the validator proves deadlock-free); under gloo each op is posted and waited
where it helps most (see [Note: eager point-to-point] in `backends.distributed.eager`: relaxations
that cannot add a hang), and stages on the same machine exchange through shared memory rather than
gloo (see [Note: same-host point-to-point] in `backends.distributed.shm`). Gradients are reduced
over the data-parallel group (all-reduce; reduce-scatter + all-gather under ZeRO-1).

Ranks: by default a `DeviceMesh` with dims `("dp", "pp")` over the whole world, so the global rank
is `dp_index * p + stage`; a caller may pass its own `mesh` (same dim names) or its own
`pp_group`/`dp_group` (e.g. Megatron's mpu), where the rank's index in `pp_group` is its stage.
Backend: NCCL for CUDA tensors, gloo for CPU (the caller initialises the default group).

    >>> # on every rank, after dist.init_process_group(...)  # doctest: +SKIP
    >>> program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    >>> engine = Engine(program, segments, loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.1))
    >>> for loss in engine.train(batches): ...

[Note: shapes are learnt once] is in `backends.distributed.shapes`, with the shape pass it
explains; [Note: sends complete lazily] in `backends.distributed.transfers`, with the
point-to-point. What both engines share (argument and batch checks, `train`, `train_step`,
`steps`, `save`/`load`, `peak_activation_bytes`) is `backends.engine.BaseEngine`.

[Note: failures] Every wait has the engine's `timeout`. A peer that dies closes its sockets (gloo's
and the shared-memory links') and the waiting rank raises `RankFailure` naming its stage, the
instruction it waited on and the peer ranks of that group; a wait that times out says the same. The
launcher (`backends.run.launch` or torchrun) then ends the other ranks, so no rank hangs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from schedcc.backends.checkpoint.files import (
    MANIFEST,
    load_stage_states,
    program_meta,
    shard_name,
    write_manifest,
    write_shard,
)
from schedcc.backends.checkpoint.state import rng_state, set_rng_state
from schedcc.backends.distributed.groups import (
    CommGroup,
    device_of,
    own_segments,
    process_groups,
    stage_ops,
)
from schedcc.backends.distributed.shapes import learn_shapes
from schedcc.backends.distributed.ties import TieGroups, plan_ties
from schedcc.backends.distributed.transfers import Transfers, first_line
from schedcc.backends.engine import BaseEngine, LossFn, OptimizerFactory, check_pair, is_pair
from schedcc.backends.runtime.stage import StageRuntime
from schedcc.backends.runtime.tied import stage_ties
from schedcc.errors import CheckpointError, RankFailure, ScheduleConfigError
from schedcc.ir import Instruction, Update
from schedcc.program import Program
from schedcc.semantics import Layout, Steps

__all__ = ["DataParallel", "Engine"]


class DataParallel:
    """`Collectives` over one stage's data-parallel process group (see
    `backends.runtime.collectives`).

    Gloo has no reduce-scatter: there it all-reduces a copy and keeps this rank's slice.
    """

    def __init__(self, dp_group, *, timeout: timedelta | None = None):
        self.dp_group = dp_group
        self.rank = dist.get_rank(dp_group)
        self.size = dist.get_world_size(dp_group)
        self._native = dist.get_backend(dp_group) != "gloo"

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """In-place SUM over the group."""
        if self.size > 1:
            dist.all_reduce(tensor, group=self.dp_group)

    def reduce_scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """SUM of `flat` (length `size * shard`) over the group; this rank's shard."""
        shard = flat.numel() // self.size
        if self.size == 1:
            return flat.clone()
        if self._native:
            out = flat.new_empty(shard)
            dist.reduce_scatter_tensor(out, flat.contiguous(), group=self.dp_group)
            return out
        total = flat.clone()
        dist.all_reduce(total, group=self.dp_group)
        return total[self.rank * shard : (self.rank + 1) * shard].clone()

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The rank-ordered concatenation of every rank's `shard`."""
        if self.size == 1:
            return shard.clone()
        if self._native:
            out = shard.new_empty(shard.numel() * self.size)
            dist.all_gather_into_tensor(out, shard.contiguous(), group=self.dp_group)
            return out
        parts = [torch.empty_like(shard) for _ in range(self.size)]
        dist.all_gather(parts, shard.contiguous(), group=self.dp_group)
        return torch.cat(parts)


class Engine(BaseEngine):
    """Trains this rank's stage of a pipelined model with `torch.distributed`.

    Args:
        program: the compiled program (`schedcc.compile(schedule, data_parallel=dp, zero=z)`).
        segments: either the whole model cut into `p*v` segments (in model order; this rank
            keeps the ones its stage holds) or only this stage's `v` segments, indexed by chunk.
            The kept modules are trained in place. Tied parameters (one `Parameter` object in
            several segments) need all `p*v` segments: only then does every rank see a tie with
            another rank's segments, refuse a program whose `tied` misses it, and check that the
            copies start equal. Given only its own segments, a rank sees ties among those alone,
            and a tie with another rank's segment must be declared (`schedcc.compile(...,
            tied=[(0, 3)])`); the group's ranks then find the shared parameters by value (see
            [Note: ties across ranks] in `backends.distributed.ties`).
        loss_fn: `loss_fn(output, target) -> scalar`, a mean over the microbatch.
        optimizer: a callable from an iterable of parameters to a `torch.optim.Optimizer`.
        mesh: a `DeviceMesh` with dims ("dp", "pp"); default: one over the whole world.
        pp_group, dp_group: the pipeline and data-parallel process groups to use instead of
            a mesh (both or neither).
        timeout: the longest any wait may take (seconds or a timedelta).
        reduce_loss: make every rank's per-batch loss the global one (two tiny collectives per
            run); otherwise only the last stage knows it and the others yield NaN.
        shared_memory: under gloo, move tensors between stages on the same machine through
            shared memory rather than gloo (see [Note: same-host point-to-point]).

    Raises:
        ScheduleConfigError: torch.distributed is not initialised, the world or process groups
            do not match `p * data_parallel`, the segments do not match the program, or
            `loss_fn`/`optimizer` is not callable; or (on every rank) segments share a
            `Parameter` the program's `tied` groups do not cover, a tied group's segments share
            none, or the copies of a tied parameter start different on the group's ranks.
        ScheduleError: the program does not validate (it could deadlock or compute wrongly).

    The default process group must already exist (`dist.init_process_group`, e.g. under
    torchrun). A batch is this rank's local `(inputs, targets)`; every rank passes its batches
    (each checks them alike, so all refuse a bad one together). `train`, `train_step`, `steps`
    and `peak_activation_bytes` are `BaseEngine`'s.
    """

    def __init__(
        self,
        program: Program,
        segments: Sequence[nn.Module],
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        *,
        mesh=None,
        pp_group=None,
        dp_group=None,
        timeout: float | timedelta = 60.0,
        reduce_loss: bool = True,
        shared_memory: bool = True,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ScheduleConfigError(
                "the distributed Engine needs torch.distributed initialised on every rank: call "
                "dist.init_process_group(...) first (torchrun sets the environment for it)"
            )
        super().__init__(program, loss_fn, optimizer)
        self.pp_group, self.dp_group = process_groups(program, mesh, pp_group, dp_group)
        self.stage = dist.get_rank(self.pp_group)
        self.timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        self.reduce_loss = reduce_loss
        schedule = program.schedule
        modules = own_segments(schedule, self.stage, segments)
        self.device = device_of(modules)
        self.data_parallel = DataParallel(self.dp_group)
        #: the process groups of the tied groups this stage holds ([Note: ties across ranks])
        self.ties = TieGroups(program, self.stage, self.pp_group, timeout=self.timeout)
        given = segments if isinstance(segments, Sequence) else modules
        ties, private = plan_ties(program, self.stage, given, modules, self.ties)
        held = [schedule.segment_of(self.stage, c) for c in range(len(modules))]
        self.runtime = StageRuntime(
            program,
            self.stage,
            modules,
            loss_fn,
            optimizer,
            collectives=self.data_parallel,
            ties=stage_ties(ties, held, modules, private),
            tie_reduce=self.ties.all_reduce,
        )
        self.rank = dist.get_rank()
        self._layout = Layout.of(schedule)
        #: This stage's program as the engine runs it: compute and update instructions, and
        #: each comm group as one `CommGroup`, indexed like the step model's steps.
        self._ops = ops = stage_ops(program, self.stage, self._layout)
        self._global_peer = {
            s: dist.get_global_rank(self.pp_group, s) for s in range(program.num_stages)
        }
        self._bounds = Steps.of([program.stages[self.stage]]).bounds[0]
        self._transfers = Transfers(
            ops,
            self.runtime,
            pp_group=self.pp_group,
            global_peer=self._global_peer,
            device=self.device,
            timeout=self.timeout,
            shared_memory=shared_memory,
        )
        #: The indices of `_ops` that `_run` visits. Under gloo a comm group does nothing where
        #: it stands (its ops are posted and waited around the computes: [Note: eager
        #: point-to-point]), so only the computes are visited; under NCCL, every one.
        self._visit = [
            index
            for index, op in enumerate(ops)
            if self._transfers.eager is None or type(op) is not CommGroup
        ]
        self._learnt = False
        self._at: int | None = None
        self._clock0 = 0.0
        #: Per run of the program: (start, end) seconds of each of `_ops` (a step of the step
        #: model), since the engine's clock 0.
        self.step_times: list[list[tuple[float, float]]] = []

    # -- public ---------------------------------------------------------------------------------

    @property
    def modules(self) -> list[nn.Module]:
        """The segments this rank holds, by chunk."""
        return self.runtime.modules

    def trace_events(self, run: int = -1) -> list[tuple[int, Instruction, float, float]]:
        """`(stage, instruction, start, end)` per instruction of run `run` (seconds)."""
        ops = self.program.stages[self.stage]
        events = []
        for (lo, hi), (start, end) in zip(self._bounds, self.step_times[run]):
            events.extend((self.stage, ops[pos], start, end) for pos in range(lo, hi))
        return events

    # -- one run of the program -----------------------------------------------------------------

    def _runtimes(self) -> list[StageRuntime]:
        return [self.runtime]

    def _prepare(self, group: list[Any], first: int) -> list[tuple[Any, Any]]:
        """Every rank checks the batches (so all raise alike, before any exchange); only the
        stages that read the inputs or the targets split them."""
        m, layout, device = self.program.schedule.num_microbatches, self._layout, self.device
        reads = [layout.stage_of[k] == self.stage for k in (0, layout.last)]
        split = []
        for index, batch in enumerate(group, first):
            if not is_pair(batch):
                raise ScheduleConfigError(f"batch {index} must be (inputs, targets) tensors")
            check_pair(*batch, index, m)
            inputs, targets = (
                list(t.to(device).chunk(m)) if r else None for t, r in zip(batch, reads)
            )
            split.append((inputs, targets))
        return split

    def _run(self, split: list[tuple[Any, Any]]) -> list[float]:
        runtime = self.runtime
        transfers = self._transfers
        if not self._learnt:
            self._learn_shapes(split[0][0])
            transfers.connect()
            self._learnt = True
        runtime.reset()
        for batch, (inputs, targets) in enumerate(split):
            runtime.load_batch(batch, inputs, targets)
        ops, clock, clock0 = self._ops, time.perf_counter, self._clock0
        times = [(0.0, 0.0)] * len(ops)  # a comm group not visited: its waits', from `finish`
        for index in self._visit:
            op = ops[index]
            self._at = index
            transfers.before(index)
            start = clock()
            if type(op) is CommGroup:
                transfers.exchange(op)
            elif isinstance(op, Update):
                self._update(op)
            else:
                runtime.run(op)
            times[index] = (start - clock0, clock() - clock0)
            transfers.after(index)
        self._at = None
        transfers.finish(times, self._clock0)
        self.step_times.append(times)
        return self._losses(len(split))

    # -- checkpoints (collective: every rank of the default group calls them) ------------------

    def save(self, path: str | os.PathLike) -> Path:
        """Write this rank's shard of a checkpoint to the directory `path`; returns the path of
        the manifest (on every rank).

        Every rank writes its own file (atomically); rank 0 writes the manifest once all are on
        disk, so a crash mid-save leaves the previous checkpoint the newest complete one. The
        directory must be one all ranks can reach (a shared filesystem across nodes).
        """
        state = self.runtime.state_dict()
        state["rng"] = rng_state()
        name = shard_name(self.stage, self.data_parallel.rank)
        entries: list = [None] * dist.get_world_size()
        dist.all_gather_object(entries, (name, write_shard(path, name, state)))
        if dist.get_rank() == 0:
            write_manifest(path, program_meta(self.program), self.steps, dict(entries))
        dist.barrier()
        return Path(path) / MANIFEST

    def load(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by `save` (or by the local backend) on every rank.

        Each rank reads and checks what its stage needs; only if every rank succeeds does any
        rank change its weights, so a bad checkpoint raises `CheckpointError` everywhere and
        nothing is partly loaded. A different data-parallel degree or ZeRO setting is
        re-sharded.
        """
        problem = None
        try:
            manifest, states = load_stage_states(path, self.program, [self.stage])
            self.runtime.check_state(states[self.stage])
        except CheckpointError as exc:
            problem = f"rank {self.rank} (stage {self.stage}): {exc}"
        problems: list = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        first = next((text for text in problems if text), None)
        if first is not None:
            raise CheckpointError(first)
        saved = states[self.stage]
        self.runtime.load_state_dict(saved)
        set_rng_state(saved[min(self.data_parallel.rank, len(saved) - 1)]["rng"])
        self.steps = manifest["step"]

    def _update(self, op: Instruction) -> None:
        try:
            self.runtime.run(op)
        except RuntimeError as exc:
            if self.data_parallel.size == 1 or isinstance(exc, RankFailure):
                raise
            ranks = dist.get_process_group_ranks(self.dp_group)
            raise RankFailure(
                f"rank {self.rank} (stage {self.stage}) failed at {op}, a collective over the "
                f"data-parallel ranks {ranks}: {first_line(exc)}"
            ) from exc

    def _losses(self, count: int) -> list[float]:
        last = self._layout.stage_of[self._layout.last]
        losses = self.runtime.losses
        values = [losses.get(b, float("nan")) for b in range(count)]
        if not self.reduce_loss:
            return values
        tensor = torch.tensor(
            values if self.stage == last else [0.0] * count,
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(tensor, group=self.pp_group)
        if self.data_parallel.size > 1:
            dist.all_reduce(tensor, group=self.dp_group)
            tensor /= self.data_parallel.size
        return tensor.tolist()

    def _learn_shapes(self, first_inputs: Sequence[torch.Tensor] | None) -> None:
        """See [Note: shapes are learnt once] in `backends.distributed.shapes`."""
        self._transfers.shapes.update(
            learn_shapes(
                self._layout,
                self.stage,
                self.runtime.modules,
                first_inputs,
                peer=self._global_peer,
                pp_group=self.pp_group,
                device=self.device,
            )
        )
        self._clock0 = time.perf_counter()

    @property
    def point_to_point(self) -> str:
        """How this stage's tensors travel (after the first run): "shared memory", "gloo",
        "shared memory + gloo" (some peers on another machine), "nccl", or "none" (p = 1)."""
        return self._transfers.describe()

    @property
    def current_instruction(self) -> str | None:
        """What this rank is executing or waiting on now (for watchdogs and error messages)."""
        if self._at is None:
            return None
        lo, hi = self._bounds[self._at]
        return " ".join(str(op) for op in self.program.stages[self.stage][lo:hi])
