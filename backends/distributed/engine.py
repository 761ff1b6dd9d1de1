"""The `torch.distributed` backend: one process per (data-parallel rank, stage).

Longer than the project's ~400-line habit on purpose: the per-rank driver (its run loop,
evaluation, the checkpoint collectives and naming a failure) shares one engine's state.

`Engine` runs one stage's program on its rank: compute and update instructions go to the shared
`StageRuntime`; each comm op is posted and waited where it helps most (see [Note: eager
point-to-point] in `backends.distributed.eager`: relaxations of the validator's model that cannot
add a hang), on one of four transports (`p2p`): NCCL on a two-rank group per direction ([Note:
one link per direction] in `backends.distributed.links`), shared memory between stages on the
same machine ([Note: same-host point-to-point] in `backends.distributed.shm`), gloo send/recv,
or gloo broadcasts. Gradients are reduced
over the data-parallel group (all-reduce; reduce-scatter + all-gather under ZeRO-1).

Ranks: by default a `DeviceMesh` over the whole world in `rank_order`: "pp-inner" (dims
`("dp", "pp")`, global rank `dp_index * p + stage`) or Megatron-LM's "dp-inner" (`("pp", "dp")`,
`stage * dp + dp_index`), see [Note: rank layout] in `backends.distributed.groups`; a caller may
pass its own groups: a `DeviceMesh` (either dim order) or a `Groups(pp=..., dp=...)` of
process groups it made (e.g. Megatron's mpu), where the rank's index in `pp` is its stage.
Backend: NCCL for CUDA tensors (or "cpu:gloo,cuda:nccl"), gloo for CPU (the caller initialises
the default group); segments on a CUDA device under a gloo pipeline group are refused.

    >>> # on every rank, after dist.init_process_group(...)  # doctest: +SKIP
    >>> program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    >>> engine = Engine(program, segments, loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.1))
    >>> for loss in engine.train(batches): ...

[Note: a header only when it changes] is in `backends.distributed.streams` (a message's spec and
meta travel only when they change, so shapes may change from batch to batch and microbatch to
microbatch); [Note: sends complete lazily] in `backends.distributed.transfers`, with the
point-to-point. What both engines share (argument and batch checks, `train`, `train_step`,
`steps`, `save`/`load`, `peak_activation_bytes`) is `backends.engine.BaseEngine`.

[Note: failures] Every wait has the engine's `timeout`: point-to-point waits are given it, and the
process groups the engine makes itself (a default mesh's) take it as their own, for every collective
on them (torch's default for a new group is 30 minutes); the default group keeps the timeout it was
made with (`schedcc run` makes it with `--timeout`), as do groups the caller passes. A peer that
dies closes its sockets (gloo's and the shared-memory links') and the waiting rank raises
`RankFailure` naming its stage, the instruction or collective it waited on and the ranks it waited
with, in one line; a wait that times out says the same (a stage that fails lets the messages it has
begun sending finish first: [Note: a message cut short] in `backends.distributed.transfers`). That
holds in a collective too (a checkpoint's save or load, the loss reduction, ReduceGrads), never a
raw gloo traceback. The launcher (`backends.run.launch` or torchrun) then ends the other ranks (a
stopped one at once), so no rank hangs. Under NCCL a point-to-point wait is a stream wait and the
host runs ahead; the run's end waits for the GPU, polling, for at most the timeout, and raises
`RankFailure` then: for its loss read, or, where nothing is read, for the previous run's end
([Note: one run ahead] in `backends.runtime.syncs`). The engine's NCCL links take the timeout plus
`WATCHDOG_GRACE_S`, so NCCL's own watchdog, which ends the process without a word, fires after the
engine has said why."""

from __future__ import annotations

import os
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from schedcc.backends.batches import is_pair, split_pair, to_device
from schedcc.backends.checkpoint.files import (
    MANIFEST,
    checkpoint_directory,
    cut_of,
    is_reshaped,
    load_stage_states,
    program_meta,
    read_checkpoint,
    shard_name,
    write_manifest,
    write_shard,
)
from schedcc.backends.checkpoint.model import model_names, read_model, rng_index
from schedcc.backends.checkpoint.reshape import runtime_shard
from schedcc.backends.checkpoint.state import rng_state, set_rng_state
from schedcc.backends.distributed.groups import (
    CommGroup,
    DataParallel,
    bound_waits,
    check_backend,
    device_of,
    own_segments,
    process_groups,
    stage_ops,
    tensor_group,
)
from schedcc.backends.distributed.links import LinkIO, Links
from schedcc.backends.distributed.norms import NormGroup
from schedcc.backends.distributed.pairs import BroadcastPairs, p2p_mode
from schedcc.backends.distributed.ties import TieGroups, plan_ties
from schedcc.backends.distributed.transfers import Transfers, first_line
from schedcc.backends.engine import (
    BaseEngine,
    LossFn,
    LRSchedulerFactory,
    OptimizerFactory,
    SegmentBuilder,
    check_precision,
    copied_state,
)
from schedcc.backends.runtime.loss_values import device_losses, read_losses
from schedcc.backends.runtime.stage import StageRuntime
from schedcc.backends.runtime.syncs import WATCHDOG_GRACE_S, RunEnds, read_within, wait_device
from schedcc.backends.runtime.tied import stage_ties
from schedcc.backends.runtime.values import concat, shapes_of
from schedcc.backends.runtime.zero import BUCKET_BYTES
from schedcc.errors import CheckpointError, RankFailure, ScheduleConfigError
from schedcc.ir import RECEIVES, Instruction, Update
from schedcc.program import Program
from schedcc.semantics import Layout, Units

__all__ = ["KEPT_RUNS", "Engine", "unit_events"]

#: The runs whose times an engine keeps, the last ones (`Engine.unit_times`): a long training
#: holds no more of them.
KEPT_RUNS = 128


def unit_events(stage: int, ops, bounds, times, own) -> list[tuple]:
    """`(stage, instruction, start, end, own)` per instruction of one run of a stage's units
    (`bounds`, their `times` and the seconds of each that were the stage's own work:
    `Engine.unit_times` and `Engine.segment_times`): a compute's in its segment ([Note: a
    compute's own time]), a receive's in taking its message once it had come, its comm group's
    takes shared among its receives ([Note: a receive's take]); None for the other
    instructions."""
    events = []
    for (lo, hi), (start, end), seconds in zip(bounds, times, own, strict=True):
        receives = sum(type(op) in RECEIVES for op in ops[lo:hi])
        for op in ops[lo:hi]:
            if op.group == "compute":
                mine = seconds
            elif type(op) in RECEIVES:
                mine = seconds / receives
            else:
                mine = None
            events.append((stage, op, start, end, mine))
    return events


class Engine(BaseEngine):
    """Trains this rank's stage of a pipelined model with `torch.distributed`.

    Args:
        program: the compiled program (`schedcc.compile(schedule, data_parallel=dp, zero=z)`).
        segments: the whole model cut into `p*v` segments (in model order; this rank keeps
            the ones its stage holds), only this stage's `v` segments, indexed by chunk, or a
            builder `build(k) -> nn.Module` called for this stage's segments alone, so the rank
            allocates only its own parameters ([Note: building only what a rank holds] in
            `backends.engine`). The kept modules are trained in place. Tied parameters (one
            `Parameter` object in several segments) need all `p*v` segments: only then does
            every rank see a tie with another rank's segments, refuse a program whose `tied`
            misses it, and check that the copies start equal. Given only its own segments (or
            a builder), a rank sees ties among those alone, and a tie with another rank's
            segment must be declared (`schedcc.compile(..., tied=[(0, 3)])`); the group's
            ranks then find the shared parameters by value (see [Note: ties across ranks] in
            `backends.distributed.ties`).
        loss_fn: `loss_fn(output, target) -> scalar`, a mean over the microbatch.
        optimizer: a callable from an iterable of parameters to a `torch.optim.Optimizer`.
        groups: the process groups, one value: a `DeviceMesh` with dims ("dp", "pp") (either
            order), or ("dp", "pp", "tp") when each stage is a tensor-parallel group running the
            user's own tensor-parallel layers ([Note: the user's tensor parallelism] in
            `backends.tensor_parallel`); or a `Groups(pp=..., dp=..., tp=None)` of groups the
            caller made. Default: a ("dp", "pp") mesh over the whole world in `rank_order`.
        rank_order: the default mesh's order: "pp-inner" (the default: a pipeline's stages
            are consecutive ranks) or "dp-inner" (Megatron-LM's: a stage's data-parallel
            peers are); see [Note: rank layout] in `backends.distributed.groups`. Not with
            `groups`, which bring their own.
        timeout: the longest any wait may take (seconds or a timedelta).
        reduce_loss: make every rank's per-batch loss the global one (two tiny collectives per
            run); otherwise only the last stage knows it and the others yield NaN. Always on
            for a program with model replicas (DualPipe), whose last stages each hold part.
        p2p: how tensors travel between stages: "nccl" (the default, and the only one, under
            NCCL: a two-rank group per direction; on a gloo group the same code with NCCL's
            blocking semantics emulated, to test what NCCL would do on the CPU), "shm" (the
            default under gloo: shared memory between same-host stages, gloo send/recv
            otherwise), "gloo" (send/recv only), or "broadcast" (`dist.broadcast` within a
            two-rank group per pair of stages, as DeepSpeed's first pipeline engine did).
        dynamic_shapes: under p2p="nccl", send every message's header, for boundaries whose
            shapes their values decide (the receiver then reads each header on the host: one
            sync per message). By default a boundary's shapes must follow from the shapes of
            the microbatch's inputs, and only the first message of each channel for new input
            shapes carries a header ([Note: certain shapes] in `backends.distributed.peers`).
        max_grad_norm, mixed_precision: as the local `Engine`'s (clipping by the whole model's
            gradient norm; bfloat16 or float16 compute with float32 master weights).
        bucket_bytes: as the local `Engine`'s: about how many bytes of gradients each
            asynchronous data-parallel reduction carries.
        lr_scheduler: as the local `Engine`'s: `lr_scheduler(optimizer)` over this rank's
            optimizer (under ZeRO its shard optimizer), stepped with every step not skipped.
        recompute_layers, compile: as the local `Engine`'s: recompute every N layers of each
            `nn.Sequential` segment in the backward; run each segment through `torch.compile`.

    Raises:
        ScheduleConfigError: torch.distributed is not initialised, the world or process groups
            do not match `p * data_parallel`, an unknown `rank_order`, the segments do not
            match the program, the builder raised or returned a non-module (naming the
            segment), the segments are on a CUDA device under a gloo pipeline group, or
            `loss_fn`/`optimizer` is not callable; or (on every rank) segments share a
            `Parameter` the program's `tied` groups do not cover, a tied group's segments share
            none, or the copies of a tied parameter start different on the group's ranks.
        ScheduleError: the program does not validate (it could deadlock or compute wrongly).

    The default process group must already exist (`dist.init_process_group`, e.g. under
    torchrun). A batch is this rank's local `(inputs, targets)`, needed only where it is read:
    the inputs on the stage holding a model replica's first segment, the targets on the last
    segment's; other ranks may pass None for either (`train_step(None, None)` on a middle
    stage, batches `(x, None)` on the first). Each rank checks what it holds and the ranks
    agree, so all refuse a bad batch together ([Note: data only where needed]). `train`,
    `train_step`, `steps` and `peak_activation_bytes` are `BaseEngine`'s.
    """

    def __init__(
        self,
        program: Program,
        segments: Sequence[nn.Module] | SegmentBuilder,
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        *,
        groups=None,
        rank_order: str | None = None,
        timeout: float | timedelta = 60.0,
        reduce_loss: bool = True,
        p2p: str | None = None,
        dynamic_shapes: bool = False,
        max_grad_norm: float | None = None,
        mixed_precision: torch.dtype | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        lr_scheduler: LRSchedulerFactory | None = None,
        recompute_layers: int | None = None,
        compile: bool | str = False,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ScheduleConfigError(
                "the distributed Engine needs torch.distributed initialised on every rank: call "
                "dist.init_process_group(...) first (torchrun sets the environment for it)"
            )
        super().__init__(program, loss_fn, optimizer, lr_scheduler)
        check_precision(program, max_grad_norm, mixed_precision)
        p2p_mode(p2p, None)  # a bad name refused before any group is made
        self.pp_group, self.dp_group = process_groups(program, groups, rank_order)
        self.p2p = p2p_mode(p2p, dist.get_backend(self.pp_group))
        self.dynamic_shapes = bool(dynamic_shapes)
        self.stage = dist.get_rank(self.pp_group)
        #: the tensor-parallel group of this stage, or None
        self.tp_group = tensor_group(groups)
        self.tp_rank = dist.get_rank(self.tp_group) if self.tp_group is not None else None
        self.timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        #: where the per-run check of the batches gathers ([Note: data only where needed]):
        #: the default group under gloo; under NCCL a gloo group over the world, so the gather
        #: moves Python objects on the host and the GPU is never synchronised for it
        self._control = None
        if dist.get_backend() != "gloo":
            self._control = dist.new_group(backend="gloo", timeout=self.timeout)
        if groups is None:  # groups made here: see [Note: failures]
            bound_waits(self.timeout, self.pp_group, self.dp_group)
        self.reduce_loss = reduce_loss
        schedule = program.schedule
        modules = own_segments(schedule, self.stage, segments)
        self.device = device_of(modules)
        check_backend(self.pp_group, self.device)
        self.data_parallel = DataParallel(self.dp_group)
        #: the process groups of the tied groups this stage holds ([Note: ties across ranks])
        self.ties = TieGroups(program, self.stage, self.pp_group, timeout=self.timeout)
        #: the replica's stages as one group, for `GradNorm`
        self.norms = NormGroup(program, self.stage, self.pp_group, timeout=self.timeout)
        self._pairs = self._links = None
        if self.p2p == "broadcast":  # see [Note: broadcast pairs]
            self._pairs = BroadcastPairs(program, self.stage, self.pp_group, timeout=self.timeout)
        elif self.p2p == "nccl":  # see [Note: one link per direction]
            emulate = dist.get_backend(self.pp_group) != "nccl"
            grace = timedelta(seconds=0 if emulate else WATCHDOG_GRACE_S)  # [Note: one run ahead]
            links = Links(program, self.stage, self.pp_group, timeout=self.timeout + grace)
            cuda = self.device.type == "cuda" and not emulate
            self._links = LinkIO(links, self.stage, emulate=emulate, cuda=cuda)
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
            norm_reduce=self._norm_reduce,
            max_grad_norm=max_grad_norm,
            mixed_precision=mixed_precision,
            tp_rank=self.tp_rank or 0,
            bucket_bytes=bucket_bytes,
            lr_scheduler=lr_scheduler,
            recompute_layers=recompute_layers,
            compile=compile,
        )
        self.rank = dist.get_rank()
        self._layout = Layout.of(schedule)
        #: This stage's program as the engine runs it: compute and update instructions, and
        #: each comm group as one `CommGroup`, indexed like the rendezvous model's units.
        self._ops = ops = stage_ops(program, self.stage, self._layout)
        self._global_peer = {
            s: dist.get_global_rank(self.pp_group, s) for s in range(program.num_stages)
        }
        self._bounds = Units.of([program.stages[self.stage]]).bounds[0]
        self._transfers = self._transfers_for(program, ops)
        #: The indices of `_ops` that `_run` visits: a comm group does nothing where it stands
        #: (its ops are posted and waited around the computes: [Note: eager point-to-point]).
        self._visit = [index for index, op in enumerate(ops) if type(op) is not CommGroup]
        #: per microbatch of the run, the spec and meta of its inputs ([Note: certain shapes])
        self._signatures: dict[int, Any] = {}
        self._connected = False
        #: the forward-only program's units, visited units and transfers, made on first use
        self._forward: tuple[list, list[int], Transfers] | None = None
        self._at: int | None = None
        self._clock0 = 0.0
        #: where a run that reads nothing on the host ends ([Note: one run ahead])
        self._run_ends = RunEnds()
        #: Per run of the program, the last `KEPT_RUNS`: (start, end) seconds of each of `_ops` (a
        #: unit of the rendezvous model), since the engine's clock 0; a compute's ends once the
        #: sends of what it made are posted (the stage's time until then: [Note: a compute's own
        #: time]).
        self.unit_times: deque[list[tuple[float, float]]] = deque(maxlen=KEPT_RUNS)
        #: Per run kept, the seconds of each unit that were the stage's own work: a compute's in
        #: its segment (the user's forward and loss, autograd's backward: [Note: a compute's own
        #: time]), a comm group's in taking what its receives got once it had come ([Note: a
        #: receive's take]); 0 for the others.
        self.segment_times: deque[list[float]] = deque(maxlen=KEPT_RUNS)
        #: The runs timed in all, the first of those kept being run `runs_timed - len(unit_times)`.
        self.runs_timed = 0

    # -- public ---------------------------------------------------------------------------------

    @property
    def modules(self) -> list[nn.Module]:
        """The segments this rank holds, by chunk."""
        return self.runtime.modules

    def trace_events(self, run: int = -1, *, own: bool = False) -> list[tuple]:
        """`(stage, instruction, start, end)` per instruction of run `run` (seconds); with `own`
        a fifth element, the seconds of it that were the stage's own work: a compute's in its
        segment, a receive's in taking its message (None for the other instructions;
        `unit_events`), as `chrome_trace` writes it."""
        ops = self.program.stages[self.stage]
        events = unit_events(
            self.stage, ops, self._bounds, self.unit_times[run], self.segment_times[run]
        )
        return events if own else [event[:4] for event in events]

    def _norm_reduce(self, part: torch.Tensor) -> None:
        """`GradNorm`'s sum: over this stage's tensor-parallel ranks, then over the stages."""
        if self.tp_group is not None:
            with self._collective("GradNorm", self.tp_group):
                dist.all_reduce(part, group=self.tp_group)
        self.norms.all_reduce(part)

    # -- one run of the program -----------------------------------------------------------------

    def _runtimes(self) -> list[StageRuntime]:
        return [self.runtime]

    @property
    def writes_metrics(self) -> bool:
        return dist.get_rank() == 0  # one rank writes the metrics stream

    def _held_modules(self) -> list[nn.Module]:
        return list(self.runtime.modules)

    def _prepare(
        self, group: list[Any], first: int, sizes: list[tuple[int, ...]] | None = None
    ) -> tuple[list[tuple[Any, Any]], list[tuple[int, ...] | None]]:
        """This stage's microbatches of each batch (of `sizes`, where given), checked where the
        data is and refused on every rank alike ([Note: data only where needed]); and `sizes`
        per batch."""
        m = self.program.schedule.num_microbatches
        per_batch = sizes or [None] * len(group)

        def split() -> tuple[list[tuple[Any, Any]], list[Any] | None, bool]:
            own = [
                self._split(batch, m, f"batch {index}", sizes=per_batch[index - first])
                for index, batch in enumerate(group, first)
            ]
            inputs = [x for _, _, xs in own if xs is not None for x in xs]
            targets = any(ys is not None for _, ys, _ in own)
            given = all(xs is not None for _, _, xs in own)
            return [(x, y) for x, y, _ in own], (inputs if given else None), targets

        return self._agreed("the batches", split, sizes=per_batch)[0], per_batch

    @property
    def _reads_inputs(self) -> bool:
        """Whether this stage holds a model replica's first segment (and reads inputs)."""
        return self._holds(self._layout.firsts)

    def _holds(self, segments: tuple[int, ...]) -> bool:
        """Whether this rank's stage holds one of `segments` (the replicas' first or last)."""
        return any(self._layout.stage_of[k] == self.stage for k in segments)

    def _split(
        self, batch: Any, m: int, where: str, *, sizes: tuple[int, ...] | None = None
    ) -> tuple[Any, Any, list[Any] | None]:
        """`(inputs, targets, split inputs)` of one batch for this stage: its `m` microbatches
        of inputs on its device where a model replica starts (segment 0's stage), of targets
        where one ends (the last segment's), None for the rest, and the inputs' microbatches
        wherever they were given (their signatures); what it was given checked.

        Raises:
            ScheduleConfigError: not a pair, no inputs on a stage that reads them, or what
                `split_pair` refuses.
        """
        if not is_pair(batch):
            raise ScheduleConfigError(f"{where} must be (inputs, targets) tensors or values")
        inputs, targets = batch
        first, last = self._reads_inputs, self._holds(self._layout.lasts)
        if first and inputs is None:
            raise ScheduleConfigError(
                f"{where}: inputs are None, but stage {self.stage} holds a model's first "
                "segment and reads them: pass the batch's inputs on this rank"
            )
        schedule = self.program.schedule
        xs, ys = split_pair(
            inputs,
            targets,
            m,
            where=where,
            need_inputs=first,
            sizes=sizes,
            parts=schedule.num_parts,
            seq_dim=schedule.seq_dim,
        )
        device = self.device
        return (
            [to_device(x, device) for x in xs] if first else None,
            [to_device(y, device) for y in ys] if last and targets is not None else None,
            xs if inputs is not None else None,  # any stage given them knows their signatures
        )

    def _agreed(
        self,
        what: str,
        split: Callable[[], tuple[Any, list[Any] | None, bool]],
        *,
        sizes: list[tuple[int, ...] | None] | None = None,
    ) -> tuple[Any, bool]:
        """`split()` is `(this stage's microbatches, the inputs' microbatches where it reads
        them, whether it holds targets)`; once every rank has checked its data, a rank that
        found a problem raises its own error and every other rank a `ScheduleConfigError`
        naming the first rank's, else `(microbatches, whether the last segment's stage holds
        targets)` is returned. Sets the run's input signatures, from the
        first stage where this rank reads no inputs ([Note: data only where needed]).

        [Note: data only where needed] Only the stage holding segment 0 (of each model
        replica) reads a batch's inputs and only the last segment's reads its targets; other
        ranks may pass None for either, as DeepSpeed's pipeline engine lets them. So a bad
        batch is seen only where its data is, and each rank checks what it holds; one small
        all-reduce per run (three flags, on gloo: on the host, never synchronising a GPU) then
        tells every rank whether any found a problem, and only then do the problems travel
        (`all_gather_object`), so all refuse together before any exchange, data-parallel
        replicas included. Under p2p="nccl" (without `dynamic_shapes`) the run's input
        signatures key what a rank knows of each message ([Note: certain shapes] in
        `backends.distributed.peers`): a rank given the inputs computes them, and where some
        rank was not, the flags say so and the first stage's travel to it, so the signatures
        match on every rank of the pipeline. The same all-reduce compares the `sizes` of
        unequal microbatches every rank was given (a checksum's largest and smallest value).
        """
        problem, failure, result, inputs, targets = None, None, None, None, False
        try:
            result, inputs, targets = split()
        except ScheduleConfigError as exc:  # raised here as the local engine raises it
            problem, failure = f"rank {self.rank} (stage {self.stage}): {exc}", exc
        except Exception as exc:  # the peers must hear of it before this rank raises
            problem, failure = f"{self._reason(exc, None)} checking {what}", exc
        certain = self.p2p == "nccl" and not self.dynamic_shapes
        mine = None
        if certain and inputs is not None:
            mine = {i: shapes_of(x) for i, x in enumerate(inputs)}
        last = self._holds(self._layout.lasts)
        # one small all-reduce says whether any rank found a problem, lacks the signatures or
        # holds the targets; only then do Python objects travel
        key = zlib.crc32(repr(sizes).encode()) if sizes is not None and any(sizes) else 0
        flags = torch.tensor(
            [problem is not None, certain and mine is None, last and targets, key, -key]
        )
        with self._collective(f"checking {what}", self._control):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._control)
        found, lacking, targets_held, most, least = flags.tolist()
        if most != -least:
            raise ScheduleConfigError(
                f"rank {self.rank} (stage {self.stage}): the ranks were given different "
                f"microbatch_sizes (this one {sizes}): give every rank the same sizes"
            )
        if found:
            entries: list = [None] * dist.get_world_size()
            with self._collective(f"checking {what}", self._control):
                dist.all_gather_object(entries, problem, group=self._control)
            if failure is not None:
                raise failure
            raise ScheduleConfigError(next(text for text in entries if text))
        if lacking:
            entries = [None] * dist.get_world_size()
            with self._collective(f"checking {what}", self._control):
                dist.all_gather_object(entries, mine, group=self._control)
            if mine is None:
                mine = entries[self._global_peer[self._layout.stage_of[0]]]
        self._signatures = mine or {}
        return result, bool(targets_held)

    def _run(self, prepared, *, read: bool = True) -> list[tuple[Any, dict[str, Any]]]:
        split, sizes = prepared
        self._connect()
        times, own = self._execute(self._ops, self._visit, self._transfers, split, sizes=sizes)
        self.unit_times.append(times)
        self.segment_times.append(own)
        self.runs_timed += 1
        return self._losses(len(split), read=read)

    def _forward_run(self, inputs: Any, targets: Any) -> tuple[float | None, Any]:
        """The forward-only program on this rank's batch, split into `num_batches * m`."""
        schedule = self.program.schedule
        m, num_batches = schedule.num_microbatches, schedule.num_batches

        def split() -> tuple[list[tuple[Any, Any]], list[Any] | None, bool]:
            xs, ys, given = self._split((inputs, targets), m * num_batches, "the batch")
            per_batch = [
                (
                    xs[b * m : (b + 1) * m] if xs is not None else None,
                    ys[b * m : (b + 1) * m] if ys is not None else None,
                )
                for b in range(num_batches)
            ]
            return per_batch, given, ys is not None

        # evaluate (a loss) or predict (outputs): as the last segment's stage was given targets
        split, evaluating = self._agreed("the batch", split)
        ops, visit, transfers = self._forward_units()
        self._execute(ops, visit, transfers, split, forward_only=True)
        if evaluating:
            return self._losses(num_batches, whole=True, reduce=True)[0][0], None
        self._wait_device()  # the outputs returned are ready
        outputs = self._gather_outputs() if self._layout.num_replicas > 1 else self.runtime.outputs
        if self.stage != self._layout.stage_of[self._layout.last]:
            return None, None
        return None, concat([outputs[i] for i in range(m * num_batches)])

    def _gather_outputs(self) -> dict[int, Any]:
        """With model replicas each replica's outputs are on its own last stage: every stage
        gives what it holds to the stage of the last segment, which returns them all (by
        microbatch); the other stages get an empty dict."""
        last = self._layout.stage_of[self._layout.last]
        held = dict(self.runtime.outputs) if self._holds(self._layout.lasts) else {}
        parts: list[Any] | None = [None] * self.program.num_stages if self.stage == last else None
        with self._collective("gathering predict()'s outputs", self.pp_group):
            dist.gather_object(held, parts, dst=self._global_peer[last], group=self.pp_group)
        return {i: out for part in parts or () for i, out in part.items()}

    def _connect(self) -> None:
        """Link the stages on first use (collective over the pipeline process group)."""
        if not self._connected:
            with self._collective("linking the stages", self.pp_group):
                dist.barrier(group=self.pp_group)  # every rank's groups are made
            self._transfers.connect()
            self._connected = True
            self._clock0 = time.perf_counter()

    def _transfers_for(self, program: Program, ops: list) -> Transfers:
        """The point-to-point of `program` (training or forward-only) on this rank."""
        return Transfers(
            ops,
            self.runtime,
            program=program,
            pp_group=self.pp_group,
            global_peer=self._global_peer,
            device=self.device,
            timeout=self.timeout,
            p2p=self.p2p,
            dynamic_shapes=self.dynamic_shapes,
            pairs=self._pairs,
            links=self._links,
        )

    def _forward_units(self) -> tuple[list, list[int], Transfers]:
        """The forward-only program's units, visited units and transfers (sharing the training
        program's links), made on first use."""
        if self._forward is None:
            self._connect()
            program = self.forward_only_program
            ops = stage_ops(program, self.stage, self._layout)
            transfers = self._transfers_for(program, ops)
            transfers.connect(linked=self._transfers)
            visit = [n for n, op in enumerate(ops) if type(op) is not CommGroup]
            self._forward = (ops, visit, transfers)
        return self._forward

    def _execute(
        self, ops, visit, transfers: Transfers, split, *, forward_only: bool = False, sizes=()
    ):
        """Run a program's units once on `split` (per batch, this stage's microbatches, of
        `sizes` where given); the (start, end) of each unit, and the seconds of each spent in
        its segment's own work ([Note: a compute's own time]). A failure tells the peers first
        ([Note: failures])."""
        runtime = self.runtime
        runtime.reset(forward_only=forward_only)
        transfers.begin(self._signatures)
        sizes = list(sizes) or [None] * len(split)
        for batch, (inputs, targets) in enumerate(split):
            runtime.load_batch(batch, inputs, targets, sizes=sizes[batch])
        clock, clock0, segment = time.perf_counter, self._clock0, runtime.segment_clock
        times = [(0.0, 0.0)] * len(ops)  # a comm group not visited: its waits', from `finish`
        own = [0.0] * len(ops)
        try:
            for index in visit:
                op = ops[index]
                self._at = None if forward_only else index
                transfers.before(index)
                before = segment.seconds
                start = clock()
                if isinstance(op, Update):
                    self._update(op)
                else:
                    runtime.run(op)
                transfers.after(index)  # a unit's span ends once its sends are posted
                times[index] = (start - clock0, clock() - clock0)
                own[index] = segment.seconds - before
            self._at = None
            transfers.finish(times, own, clock0)
        except BaseException as exc:
            transfers.abort(self._reason(exc, ops[index] if visit else None))
            raise
        return times, own

    def _wait_device(self) -> None:
        """On CUDA, the run's end: its kernels done within the timeout ([Note: failures])."""
        if not wait_device(self.device, self.timeout.total_seconds()):
            raise self._stuck("end the run")

    def _end_run(self, values: torch.Tensor, *, read: bool) -> list[float] | None:
        """A run's end ([Note: one run ahead]): `values` read within the timeout (`read`), or,
        reading nothing, the previous unread run's end waited for within it; None then.
        Outside `_execute`'s guard: on CUDA no peer is linked by shared memory to be told."""
        seconds = self.timeout.total_seconds()
        if read:
            got = read_within(values, seconds)
            if got is None:
                raise self._stuck("end the run and read its loss")
            return got
        if not self._run_ends.pace([self.device], seconds):
            raise self._stuck("end the run before last")
        return None

    def _stuck(self, what: str) -> RankFailure:
        return RankFailure(
            f"rank {self.rank} (stage {self.stage}) waited {self.timeout.total_seconds():g} s "
            f"for its GPU to {what}: a peer it exchanges with stopped or died"
        )

    def _reason(self, exc: BaseException, op: Any) -> str:
        """One line for the peers: what failed here, and where."""
        if isinstance(exc, RankFailure):
            return first_line(exc)
        where = f" at {op}" if op is not None else ""
        return f"rank {self.rank} (stage {self.stage}) failed{where}: {first_line(exc)}"

    # -- checkpoints (collective: every rank of the default group calls them) ------------------

    def save(self, path: str | os.PathLike) -> Path:
        """Write this rank's shard of a checkpoint to the directory `path`; returns the path of
        the manifest (on every rank).

        Every rank writes its own file (atomically); rank 0 writes the manifest once all are on
        disk, so a crash mid-save leaves the previous checkpoint the newest complete one. The
        directory must be one all ranks can reach (a shared filesystem across nodes).
        """
        state = self.runtime.state.state_dict()
        state["rng"] = rng_state()
        name = shard_name(self.stage, self.data_parallel.rank, self.tp_rank)
        entry = write_shard(path, name, state)
        entries: list = [None] * dist.get_world_size()
        with self._collective("the checkpoint save"):
            dist.all_gather_object(entries, (name, entry, self._own_keys()))
        if dist.get_rank() == 0:
            keys = {k: own for _, _, part in entries for k, own in part.items()}
            meta = program_meta(self.program, cut_of(keys, self._layout.stage_of))
            write_manifest(path, meta, self.steps, {name: entry for name, entry, _ in entries})
        with self._collective("the checkpoint save"):
            dist.barrier()
        return Path(path) / MANIFEST

    def load(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by `save` (or by the local backend) on every rank:
        `path` is its directory, or the manifest path `save` returned.

        Each rank reads and checks what its stage needs; only if every rank succeeds does any
        rank change its weights, so a bad checkpoint raises `CheckpointError` everywhere and
        nothing is partly loaded. A different data-parallel degree or ZeRO setting is
        re-sharded; another schedule, m, v or cut loads by parameter name, each rank reading
        and checking the shards that hold its parameters ([Note: re-shaping by name] in
        `backends.checkpoint.reshape`). Should a check itself fail otherwise (a bug), that rank
        raises its error and the others a `CheckpointError` naming it, rather than wait for it.
        """
        path = checkpoint_directory(path)
        keys = self._model_keys()
        problem, failure = None, None
        try:
            manifest, saved, rng = self._checked(path, keys)
        except CheckpointError as exc:
            problem = f"rank {self.rank} (stage {self.stage}): {exc}"
        except Exception as exc:  # the peers must hear of it before this rank raises
            problem = f"{self._reason(exc, None)} checking the checkpoint"
            failure = exc
        problems: list = [None] * dist.get_world_size()
        with self._collective("the checkpoint load"):
            dist.all_gather_object(problems, problem)
        if failure is not None:
            raise failure
        first = next((text for text in problems if text), None)
        if first is not None:
            raise CheckpointError(first)
        self.runtime.state.load_state_dict(saved)
        set_rng_state(rng)
        self.steps = manifest["step"]

    def _checked(self, path, keys) -> tuple[dict, list[dict], dict]:
        """The manifest, this stage's checked shards and this rank's RNG state; no change."""
        manifest = read_checkpoint(path)
        current = program_meta(self.program, cut_of(keys, self._layout.stage_of))
        if self.tp_rank is None and is_reshaped(manifest["meta"], current):
            names = model_names(keys)
            model = read_model(
                path,
                manifest,
                model=names,
                segments=self._own_segments(),
                rng=rng_index(self.stage, self.data_parallel.rank, self.program.num_stages),
                optimizer=self.runtime.optimizer,
            )
            shard = runtime_shard(model, path, self.runtime, names)
            return manifest, [shard], shard["rng"]
        _, states = load_stage_states(
            path, self.program, [self.stage], tp_rank=self.tp_rank, manifest=manifest
        )
        saved = states[self.stage]
        self.runtime.state.check_state(saved)
        return manifest, saved, saved[min(self.data_parallel.rank, len(saved) - 1)]["rng"]

    def _own_keys(self) -> dict[int, list[str]]:
        return {k: list(module.state_dict()) for k, module in self._own_segments().items()}

    def _model_keys(self) -> dict[int, list[str]]:
        """Per segment of the whole model, its state dict's keys, from every rank's segments."""
        every: list = [None] * dist.get_world_size()
        with self._collective("the checkpoint load"):
            dist.all_gather_object(every, self._own_keys())
        return {k: keys for part in every for k, keys in part.items()}

    def _own_segments(self) -> dict[int, nn.Module]:
        schedule = self.program.schedule
        return {
            schedule.segment_of(self.stage, c): module
            for c, module in enumerate(self.runtime.modules)
        }

    def _model_state(self, everywhere: bool) -> dict[int, dict[str, Any]] | None:
        if self.tp_group is not None:
            raise ScheduleConfigError(
                "state_dict joins whole segments; under tensor parallelism each rank holds a "
                "slice of its stage's: save a checkpoint instead"
            )
        with self.unsharded():
            own = {}
            if self.data_parallel.rank == 0:
                own = {k: copied_state(m.state_dict()) for k, m in self._own_segments().items()}
        every: list | None = [None] * dist.get_world_size()
        with self._collective("gathering the model's state dict"):
            if everywhere:
                dist.all_gather_object(every, own)
            else:
                every = every if dist.get_rank() == 0 else None
                dist.gather_object(own, every, dst=0)
        if every is None:
            return None
        return {k: state for part in every for k, state in part.items()}

    def _unshard_all(self) -> None:
        with self._collective("gathering the ZeRO-3 parameter shards", self.dp_group):
            self.runtime.state.unshard_all()

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

    def _losses(
        self, count: int, *, whole: bool = False, reduce: bool | None = None, read: bool = True
    ) -> list[tuple[Any, dict[str, Any]]]:
        """Each batch's loss over every replica, and its named parts (on the last stage's ranks);
        `whole`: of all `count` batches as one (the forward-only program's batch). The sums are
        added and reduced on the device and read once where `read` ([Note: host syncs]), else
        left there (`backends.runtime.loss_values`)."""
        last = self._holds(self._layout.lasts)
        records = self.runtime.book.device_records() if last else {}
        groups = [list(range(count))] if whole else [[b] for b in range(count)]
        names = sorted(next(iter(records.values()))[2]) if records else []
        zero = torch.zeros((), dtype=torch.float64, device=self.device)

        def added(group: list[int], pick) -> torch.Tensor:
            total = zero
            for b in group:
                if b in records:
                    total = total + pick(records[b]).to(self.device)
            return total

        sums = torch.stack(
            [added(g, lambda r: r[0]) for g in groups] + [added(g, lambda r: r[1]) for g in groups]
        )
        parts = [added(g, lambda r, name=name: r[2][name]) for g in groups for name in names]
        parts = torch.stack(parts) if parts else zero.new_zeros(0)
        if reduce is None:  # the replicas' last segments each hold part of a batch's loss
            reduce = self.reduce_loss or self._layout.num_replicas > 1
        if reduce:
            with self._collective("the loss reduction", self.pp_group):
                dist.all_reduce(sums, group=self.pp_group)
            if self.data_parallel.size > 1:
                with self._collective("the loss reduction", self.dp_group):
                    dist.all_reduce(sums, group=self.dp_group)
        if names and self.data_parallel.size > 1:
            with self._collective("the loss reduction", self.dp_group):
                dist.all_reduce(parts, group=self.dp_group)
        values = torch.cat([sums, parts])
        got = self._end_run(values, read=read and (reduce or last))
        if not read:
            return device_losses(values, len(groups), names)  # NaN where nothing is known
        if got is None:  # neither reduced nor on the last stage: nothing to know
            got = [float("nan")] * len(groups) + [1.0] * len(groups)
        return read_losses(got, len(groups), names)

    @contextmanager
    def _collective(self, what: str, group=None) -> Iterator[None]:
        """Around one collective over `group` (default: every rank): a peer's failure or the
        timeout becomes `RankFailure` naming this rank, `what` and the group's ranks."""
        try:
            yield
        except RankFailure:
            raise
        except RuntimeError as exc:  # gloo's errors, and torch's DistError
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            said = self._transfers.reason_left()  # a peer that failed may have said why
            raise RankFailure(
                f"rank {self.rank} (stage {self.stage}) failed at {what}, a collective over "
                f"ranks {ranks}: {said or first_line(exc)}"
            ) from exc

    @property
    def point_to_point(self) -> str:
        """How this stage's tensors travel (after the first run): "shared memory", "gloo",
        "shared memory + gloo" (some peers on another machine), "broadcast", "nccl", "nccl
        (emulated)" (its code path on a gloo group), or "none" (p = 1)."""
        return self._transfers.describe()

    @property
    def current_instruction(self) -> str | None:
        """What this rank is executing or waiting on now (for watchdogs and error messages)."""
        if self._at is None:
            return None
        lo, hi = self._bounds[self._at]
        return " ".join(str(op) for op in self.program.stages[self.stage][lo:hi])
