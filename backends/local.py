"""The local backend: every stage (and data-parallel replica) of a program in one process.

Each replica runs its stages in turns, each stage advancing until it waits at a comm group, in
the rendezvous model the validator proves (see the note below). Data-parallel replicas run as
threads whose collectives meet at a barrier and sum in rank order, so results are deterministic.
With float64 this backend matches non-pipelined training to ~1e-12: it is the oracle the
distributed backend is tested against.

[Note: the local backend runs the rendezvous model] (docs/design.md, "Semantics") A stage that
reaches a comm group *posts* all of it: each send's tensor goes into a mailbox keyed by the route
the validator pairs it with (`comm_route`), and each receive is marked as expected. The group is
*done* once each send is expected by its receiver and each receive has its tensor, i.e. once
every op's partner group is posted, and only then does the stage go on. That is the rendezvous model
itself, so a program runs here exactly when the validator accepts it (posting a group's sends
before waiting on any receive is what runs `F0 [RG0 SA0] B0` against `[RA0] F0 B0 [SG0]`; waiting
on each receive in turn is a stricter model, which deadlocked there). The distributed backend runs
a relaxation of it on every transport (NCCL's per-direction links, gloo, shared memory): eager
sends, receives posted ahead. None adds a wait or changes a pairing, so none can hang or change
a number: [Note: eager point-to-point] in `backends.distributed.eager` gives the argument.

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
import math
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from schedcc.backends.batches import local_batches, same_sizes, split_pair
from schedcc.backends.checkpoint.files import (
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
from schedcc.backends.checkpoint.model import model_names, read_model
from schedcc.backends.checkpoint.reshape import runtime_shard
from schedcc.backends.checkpoint.state import rng_state, set_rng_state
from schedcc.backends.engine import (
    BaseEngine,
    LossFn,
    LRSchedulerFactory,
    OptimizerFactory,
    SegmentBuilder,
    build_segments,
    check_precision,
    check_segments,
    copied_state,
    is_builder,
)
from schedcc.backends.runtime.boundary import Message
from schedcc.backends.runtime.clipping import NormMeeting
from schedcc.backends.runtime.collectives import Meeting, ThreadCollectives
from schedcc.backends.runtime.loss_values import device_losses, read_losses
from schedcc.backends.runtime.stage import StageRuntime
from schedcc.backends.runtime.syncs import RunEnds, host_read
from schedcc.backends.runtime.tied import (
    TieMeetings,
    built_ties,
    check_ties,
    private_copies,
    stage_ties,
)
from schedcc.backends.runtime.values import concat
from schedcc.backends.runtime.zero import BUCKET_BYTES
from schedcc.errors import DeadlockError
from schedcc.ir import Comm, GradNorm, Instruction, ReduceTied
from schedcc.program import Program
from schedcc.semantics import Layout, Units, comm_route
from schedcc.semantics.collectives import tie_members

__all__ = ["Engine"]

#: Per batch of a run, per replica: the microbatches of the inputs and of the targets.
Microbatches = list[tuple[list[Any], list[Any]]]


class Engine(BaseEngine):
    """Train `segments` with `program`, every stage in this process.

    Args:
        program: a compiled program; it is validated again here (a program that does not validate
            is refused with its `ScheduleError`).
        segments: the model cut into `p * v` modules, in model order (see `schedcc.partition`),
            or a builder `build(k) -> nn.Module`, called here for every segment `k` in order
            (`backends.engine.build_segments`; segments built apart tie by value, as on the
            distributed engine: declare the ties with `schedcc.compile(..., tied=...)`).
            They are trained in place. With `data_parallel > 1` they are replica 0; the other
            replicas are deep copies and hold the same weights after every step.
        loss_fn: `loss_fn(output, targets)`: a scalar mean over the microbatch, a
            `(loss_sum, count)` pair or a dict of named scalars (`backends.runtime.losses`).
        optimizer: a callable from an iterable of parameters to a `torch.optim.Optimizer`.
        max_grad_norm: clip the whole model's gradient to this norm before each step, exactly
            as `torch.nn.utils.clip_grad_norm_` on the non-pipelined model; needs a program
            compiled with `grad_norm=True`, which also skips any step whose gradients are not
            finite (`skipped_steps`, `last_grad_norm`).
        mixed_precision: `torch.bfloat16` or `torch.float16` (dynamic loss scaling; needs
            `grad_norm=True`): compute and boundary tensors in that dtype, float32 master
            weights and optimizer state ([Note: mixed precision] in
            `backends.runtime.precision`).
        bucket_bytes: about how many bytes of gradients each launched data-parallel
            reduction carries (default 25 MiB, as torch DDP's; [Note: contiguous gradient
            buckets] in `backends.runtime.zero`).
        lr_scheduler: `lr_scheduler(optimizer) -> torch.optim.lr_scheduler.LRScheduler`:
            each stage's (and replica's) optimizer gets its own, stepped once per optimizer
            step that is not skipped, as the non-pipelined loop steps it once per batch; its
            state is saved in checkpoints.
        recompute_layers: N: each segment (an `nn.Sequential`, as `schedcc.partition` cuts)
            keeps only every N-th layer boundary and recomputes each group of N layers in the
            backward, as DeepSpeed's `activation_checkpoint_interval` ([Note: recomputing
            every N layers] in `backends.runtime.segment_calls`).
        compile: True (inductor) or a `torch.compile` backend's name (e.g. "aot_eager"): each
            segment, or each group of `recompute_layers`, runs compiled ([Note: compiled
            segments]).

    Raises:
        ScheduleConfigError: the number of segments is not `p * v`, one is not a module, the
            builder raised or returned a non-module (naming the segment), or
            `loss_fn`/`optimizer` is not callable, `recompute_layers` is given for a segment
            that is not an `nn.Sequential`, or `compile` names no backend; or segments share a
            `Parameter` object (a tied embedding and LM head) that the program's `tied` groups
            do not cover, or a tied group's segments share none (`backends.runtime.tied`).
        ScheduleError: the program does not validate.

    A batch is `(inputs, targets)`, each a tensor or any nesting of tuple, list and dict of
    tensors and constants, split along dim 0 into `m` microbatches (`backends.batches`). With
    `data_parallel = dp > 1` a batch is either a sequence of `dp` local batches (one per
    replica, in data-parallel order) or one `(inputs, targets)` global batch that is split into
    `dp` equal local batches; a step equals non-pipelined training on their concatenation.
    `train`, `train_step`, `evaluate`, `predict`, `steps` and `peak_activation_bytes` are
    `BaseEngine`'s.
    """

    def __init__(
        self,
        program: Program,
        segments: Sequence[nn.Module] | SegmentBuilder,
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        *,
        max_grad_norm: float | None = None,
        mixed_precision: torch.dtype | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        lr_scheduler: LRSchedulerFactory | None = None,
        recompute_layers: int | None = None,
        compile: bool | str = False,
    ) -> None:
        super().__init__(program, loss_fn, optimizer, lr_scheduler)
        check_precision(program, max_grad_norm, mixed_precision)
        schedule = program.schedule
        built = is_builder(segments)
        if built:
            made = build_segments(schedule, segments, range(schedule.num_segments))
            segments = [made[k] for k in range(schedule.num_segments)]
        segments = check_segments(schedule, segments)
        # refuse segments that share a parameter the program does not tie, before anything runs
        held = dict(enumerate(segments))
        if built:  # built apart: [Note: building only what a rank holds]
            length = schedule.num_segments // type(schedule).num_replicas
            ties = built_ties(held, program.tied, range(len(program.tied)), length=length)
        else:
            ties = check_ties(held, program.tied, whole=range(len(program.tied)))
        private = private_copies(ties, range(schedule.num_segments), held)
        tied = program.tied
        self._tie_members = tie_members(tied, Layout.of(schedule))
        self.segments = segments
        self._layout = layout = Layout.of(schedule)
        devices = list(dict.fromkeys(p.device for seg in segments for p in seg.parameters()))
        dp = program.data_parallel
        replicas = [segments] + [copy.deepcopy(segments) for _ in range(dp - 1)]
        meetings = [Meeting(dp) for _ in range(schedule.num_stages)]
        held = [[[replica[k] for k in ks] for ks in layout.segment] for replica in replicas]
        # every stage's private copies of its tied parameters, taken while every parameter is
        # whole: under ZeRO-3 a runtime releases its modules' parameters as it is made, and a
        # tie's first copy is the very Parameter another stage copies from
        stage_copies = [
            [stage_ties(ties, layout.segment[s], modules, private) for s, modules in enumerate(r)]
            for r in held
        ]
        self.runtimes: list[list[StageRuntime]] = [
            [
                StageRuntime(
                    program,
                    s,
                    held[r][s],
                    loss_fn,
                    optimizer,
                    collectives=ThreadCollectives(meetings[s], r) if dp > 1 else None,
                    ties=stage_copies[r][s],
                    max_grad_norm=max_grad_norm,
                    mixed_precision=mixed_precision,
                    bucket_bytes=bucket_bytes,
                    lr_scheduler=lr_scheduler,
                    recompute_layers=recompute_layers,
                    compile=compile,
                )
                for s in range(schedule.num_stages)
            ]
            for r in range(dp)
        ]
        self._meetings = meetings
        #: the devices the stages run on, and where a run that reads nothing ends ([Note: one
        #: run ahead] in `backends.runtime.syncs`)
        self._devices = devices
        self._run_ends = RunEnds()
        #: Per stage, its program as this engine runs it: compute and update instructions, and
        #: each comm group as one `_CommGroup`.
        self._ops = [_stage_ops(program, s, layout) for s in range(schedule.num_stages)]
        self._forward_ops: list[list[Instruction | _CommGroup]] | None = None

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> Path:
        """Write a checkpoint of every stage and replica to the directory `path`.

        One file per (stage, data-parallel rank) and a manifest written last; see
        `schedcc.backends.checkpoint.files`. Returns the path of the manifest.
        """
        files = {}
        for r, runtimes in enumerate(self.runtimes):
            for s, runtime in enumerate(runtimes):
                state = runtime.state.state_dict()
                state["rng"] = rng_state()
                files[shard_name(s, r)] = write_shard(path, shard_name(s, r), state)
        return write_manifest(path, self._meta(), self.steps, files)

    def load(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by `save` (or by the distributed backend): `path` is its
        directory, or the manifest path `save` returned.

        Everything is read and checked before anything changes: a checkpoint with a missing,
        truncated or altered file, or one that does not fit this model, raises
        `CheckpointError` and leaves the engine as it was. A different data-parallel degree or
        ZeRO setting is re-sharded; another schedule, m, v or cut loads by parameter name
        ([Note: re-shaping by name] in `backends.checkpoint.reshape`).
        """
        path = checkpoint_directory(path)
        manifest = read_checkpoint(path)
        if is_reshaped(manifest["meta"], self._meta()):
            states, rng = self._reshaped(path, manifest)
        else:
            stages = range(self.program.num_stages)
            _, saved = load_stage_states(path, self.program, stages, manifest=manifest)
            states, rng = saved, saved[0][0]["rng"]
        for runtimes in self.runtimes:
            for s, runtime in enumerate(runtimes):
                runtime.state.check_state(states[s])
        for runtimes in self.runtimes:
            for s, runtime in enumerate(runtimes):
                runtime.state.load_state_dict(states[s])
        set_rng_state(rng)
        self.steps = manifest["step"]

    def _meta(self) -> dict[str, Any]:
        keys = {k: list(segment.state_dict()) for k, segment in enumerate(self.segments)}
        return program_meta(self.program, cut_of(keys, self._layout.stage_of))

    def _reshaped(self, path, manifest) -> tuple[dict[int, list[dict]], dict]:
        """Each stage's shard taken by name from a checkpoint of another shape, and the RNG
        state of global index 0 (one process: [Note: re-shaping by name])."""
        keys = {k: list(segment.state_dict()) for k, segment in enumerate(self.segments)}
        names = model_names(keys)
        optimizer = next((rt.optimizer for rt in self.runtimes[0] if rt.optimizer), None)
        saved = read_model(path, manifest, model=names, rng=0, optimizer=optimizer)
        states = {
            s: [runtime_shard(saved, path, runtime, names)]
            for s, runtime in enumerate(self.runtimes[0])
        }
        return states, saved.rng

    def _model_state(self, everywhere: bool) -> dict[int, dict[str, Any]]:
        with self.unsharded():
            return {k: copied_state(seg.state_dict()) for k, seg in enumerate(self.segments)}

    # -- batches --------------------------------------------------------------------------------

    def _runtimes(self) -> list[StageRuntime]:
        return self.runtimes[0]

    def _all_runtimes(self) -> list[StageRuntime]:
        return [rt for runtimes in self.runtimes for rt in runtimes]

    def _unshard_all(self) -> None:
        # every replica is here: concatenate their shards instead of meeting in a collective
        for s in range(self.program.num_stages):
            replicas = [runtimes[s] for runtimes in self.runtimes]
            full = [torch.cat(shards) for shards in zip(*(rt.state.shards for rt in replicas))]
            for rt in replicas:
                rt.state.unshard_all([flat.clone() for flat in full])

    def _prepare(
        self, group: list[Any], first: int, sizes: list[tuple[int, ...]] | None = None
    ) -> tuple[list[Microbatches], list[tuple[int, ...] | None]]:
        per_batch = sizes or [None] * len(group)
        split = [
            self._split(b, first + j, sizes=n) for j, (b, n) in enumerate(zip(group, per_batch))
        ]
        return split, per_batch

    def _split(
        self, batch: Any, index: int, m: int | None = None, sizes: tuple[int, ...] | None = None
    ) -> Microbatches:
        """Per replica, the microbatches of inputs and targets (of `sizes` samples each, where
        given); checks everything first."""
        dp, m = self.program.data_parallel, m or self.program.schedule.num_microbatches
        local = local_batches(batch, index, dp)
        same_sizes(local, index)
        where = [f"batch {index}" + (f" (replica {r})" if dp > 1 else "") for r in range(dp)]
        parts, seq_dim = self.program.schedule.num_parts, self.program.schedule.seq_dim
        return [
            split_pair(x, y, m, where=w, sizes=sizes, parts=parts, seq_dim=seq_dim)
            for (x, y), w in zip(local, where)
        ]

    def _held_modules(self) -> list[nn.Module]:
        return [mod for runtimes in self.runtimes for rt in runtimes for mod in rt.modules]

    # -- running --------------------------------------------------------------------------------

    def _run(self, prepared, *, read: bool = True) -> list[tuple[Any, dict[str, Any]]]:
        """Run the program once over what `_prepare` made: per batch, per replica
        microbatches, and per batch its microbatches' sizes (None: equal)."""
        batches, sizes = prepared
        self._load(batches, forward_only=False, sizes=sizes)
        values, names = self._loss_values(len(batches))
        if read:
            return read_losses(host_read(values), len(batches), names)
        # no peer can stop this run: wait for the previous one without a bound
        self._run_ends.pace(self._devices, math.inf)  # [Note: one run ahead]
        return device_losses(values, len(batches), names)

    def _forward_run(self, inputs: Any, targets: Any) -> tuple[float | None, Any]:
        """The forward-only program on one batch, split into `num_batches * m` microbatches."""
        schedule = self.program.schedule
        m, num_batches = schedule.num_microbatches, schedule.num_batches
        replicas = self._split((inputs, targets), 0, m * num_batches)
        batches = [
            [(xs[b * m : (b + 1) * m], ys[b * m : (b + 1) * m]) for xs, ys in replicas]
            for b in range(num_batches)
        ]
        if self._forward_ops is None:
            program = self.forward_only_program
            self._forward_ops = [
                _stage_ops(program, s, self._layout) for s in range(schedule.num_stages)
            ]
        self._load(batches, forward_only=True, targets=targets is not None)
        if targets is not None:
            values, names = self._loss_values(num_batches, whole=True)
            return read_losses(host_read(values), 1, names)[0][0], None
        lasts = self._ends(self._layout.lasts)  # a replica's outputs are on its last stage
        outputs = [
            next(runtimes[s].outputs[i] for s in lasts if i in runtimes[s].outputs)
            for runtimes in self.runtimes
            for i in range(m * num_batches)
        ]
        return None, concat(outputs)

    def _ends(self, segments: tuple[int, ...]) -> list[int]:
        """The stages holding `segments` (the replicas' first or last ones)."""
        return sorted({self._layout.stage_of[k] for k in segments})

    def _load(
        self,
        batches: list[Microbatches],
        *,
        forward_only: bool,
        targets: bool = True,
        sizes: Sequence[tuple[int, ...] | None] = (),
    ):
        """Load `batches` (of `sizes`, where given) into every runtime and run the program (or
        the forward-only one)."""
        firsts, lasts = self._ends(self._layout.firsts), self._ends(self._layout.lasts)
        sizes = list(sizes) or [None] * len(batches)
        for r, runtimes in enumerate(self.runtimes):
            for s, rt in enumerate(runtimes):
                rt.reset(forward_only=forward_only)
                for b, local in enumerate(batches):
                    inputs, target = local[r]
                    target = target if s in lasts and targets else None
                    rt.load_batch(b, inputs if s in firsts else None, target, sizes=sizes[b])
        ops = self._forward_ops if forward_only else self._ops
        if len(self.runtimes) == 1:
            self._run_replica(0, ops)
        else:
            self._run_threads(ops)

    def _loss_values(self, count: int, *, whole: bool = False) -> tuple[torch.Tensor, list[str]]:
        """Each batch's (over every replica) loss total, count and named parts as one float64
        vector on the device, and the parts' names (`backends.runtime.loss_values`); `whole`:
        of all batches as one (the forward-only program's batch). The sums are added as the
        distributed engine adds them, so both give the same bits: each stage's records in batch
        order, then the stages, then the data-parallel replicas."""
        lasts = self._ends(self._layout.lasts)
        groups = [list(range(count))] if whole else [[b] for b in range(count)]
        books = [[rs[s].book.device_records() for s in lasts] for rs in self.runtimes]
        first = next((rec for rs in books for stage in rs for rec in stage.values()), None)
        names = list(first[2]) if first is not None else []
        device = first[0].device if first is not None else torch.device("cpu")
        zero = torch.zeros((), dtype=torch.float64, device=device)

        def added(group: list[int], pick) -> torch.Tensor:
            replicas = zero
            for rs in books:
                stages = zero
                for stage in rs:
                    held = zero
                    for b in group:
                        if b in stage:
                            held = held + pick(stage[b]).to(device)
                    stages = stages + held
                replicas = replicas + stages
            return replicas

        sums = [added(g, lambda r: r[0]) for g in groups]
        sums += [added(g, lambda r: r[1]) for g in groups]
        sums += [added(g, lambda r, name=name: r[2][name]) for g in groups for name in names]
        return torch.stack(sums), names

    def _run_threads(self, ops) -> None:
        errors: list[BaseException] = []

        def body(r: int) -> None:
            try:
                self._run_replica(r, ops)
            except BaseException as error:
                errors.append(error)
                for meeting in self._meetings:
                    meeting.barrier.abort()  # wake the other replicas; they fail too

        threads = [threading.Thread(target=body, args=(r,)) for r in range(len(self.runtimes))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for meeting in self._meetings:
            meeting.barrier.reset()
        if errors:
            broken = (threading.BrokenBarrierError,)
            raise next((e for e in errors if not isinstance(e, broken)), errors[0])

    def _run_replica(self, replica: int, all_ops) -> None:
        """Run every stage of one replica in turns until all finish (see the note above)."""
        runtimes = self.runtimes[replica]
        mail = _Mailbox(TieMeetings(self._tie_members), NormMeeting(len(runtimes)))
        cursors = [_Cursor() for _ in all_ops]
        while True:
            moved = False
            for runtime, ops, cursor in zip(runtimes, all_ops, cursors):
                moved |= cursor.advance(runtime, ops, mail)
            if all(cursor.pos == len(ops) for cursor, ops in zip(cursors, all_ops)):
                return
            if not moved:
                waiting = "; ".join(
                    f"stage {s} at [{ops[cursor.pos]}]"
                    for s, (cursor, ops) in enumerate(zip(cursors, all_ops))
                    if cursor.pos < len(ops)
                )
                raise DeadlockError(
                    "local backend: every unfinished stage waits at a comm group whose partner "
                    f"is never posted: {waiting}"
                )


class _CommGroup:
    """One comm group of a stage's program: `(op, route)` for its sends and for its receives."""

    __slots__ = ("ops", "recvs", "sends")

    def __init__(self, ops: Sequence[Comm], routes: Sequence[tuple]) -> None:
        self.ops = tuple(ops)
        self.sends = [(op, route) for op, route in zip(ops, routes) if op.is_send]
        self.recvs = [(op, route) for op, route in zip(ops, routes) if not op.is_send]

    def __str__(self) -> str:
        return " ".join(map(str, self.ops))


def _stage_ops(program: Program, stage: int, layout: Layout) -> list[Instruction | _CommGroup]:
    """Stage `stage`'s program: its compute and update instructions, and its comm groups."""
    ops = program.stages[stage]
    units = Units.of([ops])
    items: list[Instruction | _CommGroup] = []
    for (lo, hi), group in zip(units.bounds[0], units.is_group[0]):
        if not group:
            items.append(ops[lo])
            continue
        comms = ops[lo:hi]
        # a validated program (the Engine refuses any other) has a route for every comm op
        items.append(_CommGroup(comms, [comm_route(layout, stage, op) for op in comms]))
    return items


class _Mailbox:
    """The point-to-point of one run of one replica: what each posted send carries, and which
    receives are posted, by route (a route names one tensor of the run)."""

    __slots__ = ("expected", "messages", "norms", "ties")

    def __init__(self, ties: TieMeetings, norms: NormMeeting) -> None:
        self.messages: dict[tuple, Message] = {}
        self.expected: set[tuple] = set()
        self.ties = ties  # where the stages meet for ReduceTied
        self.norms = norms  # and for GradNorm

    def post(self, group: _CommGroup, runtime: StageRuntime) -> None:
        for op, route in group.sends:
            self.messages[route] = runtime.outgoing(op).clone()  # what a network would do
        self.expected.update(route for _, route in group.recvs)

    def done(self, group: _CommGroup) -> bool:
        """Whether every op's partner group has been posted (rendezvous)."""
        return all(route in self.expected for _, route in group.sends) and all(
            route in self.messages for _, route in group.recvs
        )


class _Cursor:
    """Where one stage is in its program during a run: a position, and whether the comm group
    there is already posted."""

    __slots__ = ("pos", "posted")

    def __init__(self) -> None:
        self.pos = 0
        self.posted = False

    def advance(self, runtime: StageRuntime, ops: Sequence, mail: _Mailbox) -> bool:
        """Run until the end or a comm group that is not done; whether anything happened."""
        start, was_posted = self.pos, self.posted
        while self.pos < len(ops):
            op = ops[self.pos]
            if type(op) is _CommGroup:
                if not self.posted:
                    mail.post(op, runtime)
                    self.posted = True
                if not mail.done(op):
                    break
                for recv, route in op.recvs:
                    runtime.incoming(recv, mail.messages.pop(route))
                self.posted = False
            elif type(op) is ReduceTied:  # a collective of this replica's stages: rendezvous
                if not self.posted:
                    mail.ties.post(op.tie, runtime.stage, runtime.ties.parts(op.tie))
                    self.posted = True
                totals = mail.ties.take(op.tie, runtime.stage)
                if totals is None:
                    break
                runtime.ties.apply(op.tie, totals)
                self.posted = False
            elif type(op) is GradNorm:  # a collective of all this replica's stages
                if not self.posted:
                    mail.norms.post(runtime.stage, runtime.norm_part())
                    self.posted = True
                total = mail.norms.take(runtime.stage)
                if total is None:
                    break
                runtime.apply_norm(total)
                self.posted = False
            else:
                runtime.run(op)
            self.pos += 1
        return self.pos != start or self.posted != was_posted
