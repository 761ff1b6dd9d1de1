"""The `torch.distributed` backend: one process per (data-parallel rank, stage).

`Engine` runs one stage's program on its rank: compute and update instructions go to the shared
`StageRuntime`; each comm group is posted whole (ONE `torch.distributed.batch_isend_irecv` under
NCCL; op by op under gloo, see [Note: receives are posted one group early]) and its receives are
waited before the next instruction (the execution semantics the validator proves deadlock-free,
relaxed only in ways that cannot add a hang). Gradients are
reduced over the data-parallel group (all-reduce; reduce-scatter + all-gather under ZeRO-1).

Ranks: by default a `DeviceMesh` with dims `("dp", "pp")` over the whole world, so the global rank
is `dp_index * p + stage`; a caller may pass its own `mesh` (same dim names) or its own
`pp_group`/`dp_group` (e.g. Megatron's mpu), where the rank's index in `pp_group` is its stage.
Backend: NCCL for CUDA tensors, gloo for CPU (the caller initialises the default group).

    >>> # on every rank, after dist.init_process_group(...)  # doctest: +SKIP
    >>> program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    >>> engine = Engine(program, segments, loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.1))
    >>> for loss in engine.train(batches): ...

[Note: shapes are learnt once] A receive needs a buffer of the right shape and dtype. On the first
run, before any instruction, a *shape pass* pushes microbatch 0 forward through the segments in
model order without autograd (and without touching the RNG), each stage sending the next a small
metadata tensor and the activation itself; every stage then knows the shape of every activation
it receives, and of every gradient (the gradient of an activation has its shape). Nothing but the
tensors themselves is sent afterwards; a send whose shape differs from the learnt one raises.

[Note: sends complete lazily] Where the backend returns a handle per op (gloo), a group's receives
are waited before the next instruction and its sends only at the end of the run (their tensors
are kept alive until then), as torch.distributed.pipelining does. This only relaxes the
rendezvous model the validator proves deadlock-free (a send never holds its stage back), so it
cannot introduce a hang; it keeps a stage from idling while its peer has not yet reached the
matching receive. Under NCCL a batch is one coalesced handle, waited whole.

[Note: receives are posted one group early] Gloo moves a message only once both sides have posted
it: the receiver announces its buffer, then the sender writes the data. So under gloo each comm
group is posted op by op, and once its own receives and sends are posted, the receives of the
next group that has any are posted too (a buffer each); they are waited only at their own group.
The data then travels while this stage computes instead of after it reaches the group. Per peer,
receives are still posted in program order, so each still pairs with the same send; a receive
posted early never holds a stage back, so, like lazy sends, this cannot introduce a hang. NCCL
orders its operations on a stream, where an early receive could hold back a later send: there
each group stays one `batch_isend_irecv`, posted at its place.

[Note: failures] Every wait has the engine's `timeout`. A peer that dies closes its sockets (gloo)
and the waiting rank raises `RankFailure` naming its stage, the instruction it waited on and the
peer ranks of that group; a wait that times out says the same. The launcher (`backends.launch` or
torchrun) then ends the other ranks, so no rank hangs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from itertools import islice

import torch
import torch.distributed as dist
from torch import nn

from schedcc.analysis import Layout, Steps, comm_route
from schedcc.backends.checkpoint import (
    load_stage_states,
    program_meta,
    shard_name,
    write_manifest,
    write_shard,
)
from schedcc.backends.launch import RankFailure
from schedcc.backends.runtime import StageRuntime
from schedcc.backends.state import rng_state, set_rng_state
from schedcc.errors import CheckpointError, ScheduleConfigError
from schedcc.ir import Instruction
from schedcc.program import Program
from schedcc.validate import validate

__all__ = ["DataParallel", "Engine", "RankFailure"]

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_MAX_DIMS = 8


class DataParallel:
    """`Collectives` over one stage's data-parallel group (see `backends.runtime.Collectives`).

    Gloo has no reduce-scatter: there it all-reduces a copy and keeps this rank's slice.
    """

    def __init__(self, group, *, timeout: timedelta | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._native = dist.get_backend(group) != "gloo"

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """In-place SUM over the group."""
        if self.size > 1:
            dist.all_reduce(tensor, group=self.group)

    def reduce_scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """SUM of `flat` (length `size * shard`) over the group; this rank's shard."""
        shard = flat.numel() // self.size
        if self.size == 1:
            return flat.clone()
        if self._native:
            out = flat.new_empty(shard)
            dist.reduce_scatter_tensor(out, flat.contiguous(), group=self.group)
            return out
        total = flat.clone()
        dist.all_reduce(total, group=self.group)
        return total[self.rank * shard : (self.rank + 1) * shard].clone()

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The rank-ordered concatenation of every rank's `shard`."""
        if self.size == 1:
            return shard.clone()
        if self._native:
            out = shard.new_empty(shard.numel() * self.size)
            dist.all_gather_into_tensor(out, shard.contiguous(), group=self.group)
            return out
        parts = [torch.empty_like(shard) for _ in range(self.size)]
        dist.all_gather(parts, shard.contiguous(), group=self.group)
        return torch.cat(parts)


class _Group:
    """One comm group of the program, ready to post.

    `items` are `(op, is_send, peer stage, shape key)` in program order; `sends` and `recvs` the
    same split by direction (a receive's shape key says what buffer it needs).
    """

    __slots__ = ("items", "peers", "recvs", "sends")

    def __init__(self, items: list[tuple[Instruction, bool, int, tuple[str, int]]]):
        self.items = items
        self.peers = sorted({peer for _, _, peer, _ in items})
        self.sends = [(op, peer, key) for op, is_send, peer, key in items if is_send]
        self.recvs = [(op, peer, key) for op, is_send, peer, key in items if not is_send]


class Engine:
    """Trains this rank's stage of a pipelined model with `torch.distributed`.

    Args:
        program: the compiled program (`schedcc.compile(schedule, data_parallel=dp, zero=z)`).
        segments: either the whole model cut into `p*v` segments (in model order; this rank
            keeps the ones its stage holds) or only this stage's `v` segments, indexed by chunk.
            The kept modules are trained in place.
        loss_fn: `loss_fn(output, target) -> scalar`, a mean over the microbatch.
        optimizer: a callable from an iterable of parameters to a `torch.optim.Optimizer`.
        mesh: a `DeviceMesh` with dims ("dp", "pp"); default: one over the whole world.
        pp_group, dp_group: process groups to use instead of a mesh (both or neither).
        timeout: the longest any wait may take (seconds or a timedelta).
        reduce_loss: make every rank's per-batch loss the global one (two tiny collectives per
            run); otherwise only the last stage knows it and the others yield NaN.

    Raises:
        ScheduleConfigError: torch.distributed is not initialised, the world or groups do not
            match `p * data_parallel`, or the segments do not match the program.
        ScheduleError: the program does not validate (it could deadlock or compute wrongly).

    The default group must already exist (`dist.init_process_group`, e.g. under torchrun).
    """

    def __init__(
        self,
        program: Program,
        segments: Sequence[nn.Module],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer],
        *,
        mesh=None,
        pp_group=None,
        dp_group=None,
        timeout: float | timedelta = 60.0,
        reduce_loss: bool = True,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ScheduleConfigError(
                "the distributed Engine needs torch.distributed initialised on every rank: call "
                "dist.init_process_group(...) first (torchrun sets the environment for it)"
            )
        validate(program)  # a program that does not validate could hang: refuse it here
        self.program = program
        self.pp_group, self.dp_group = _groups(program, mesh, pp_group, dp_group)
        self.stage = dist.get_rank(self.pp_group)
        self.timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        self.reduce_loss = reduce_loss
        schedule = program.schedule
        modules = _own_segments(schedule, self.stage, segments)
        self.device = _device_of(modules)
        self.data_parallel = DataParallel(self.dp_group)
        self.runtime = StageRuntime(
            program, self.stage, modules, loss_fn, optimizer, collectives=self.data_parallel
        )
        self.rank = dist.get_rank()
        self._layout = Layout.of(schedule)
        self._steps = _plan(program, self.stage, self._layout)
        self._global_peer = {
            s: dist.get_global_rank(self.pp_group, s) for s in range(program.num_stages)
        }
        self._bounds = Steps.of([program.stages[self.stage]]).bounds[0]
        self._shapes: dict[tuple[str, int], tuple[tuple[int, ...], torch.dtype]] = {}
        self._learnt = False
        self._sending: list[tuple[object, torch.Tensor, _Group]] = []
        # see [Note: receives are posted one group early]
        self._early = dist.get_backend(self.pp_group) == "gloo"
        self._next_recv = _next_receiving(self._steps)
        self._posted: dict[int, list[tuple[Instruction, torch.Tensor, object]]] = {}
        self._at: int | None = None
        self._clock0 = 0.0
        #: Per run of the program: (start, end) seconds of each step, since the engine's clock 0.
        self.step_times: list[list[tuple[float, float]]] = []
        #: Optimizer steps taken so far (batches trained); saved in checkpoints.
        self.steps = 0

    # -- public ---------------------------------------------------------------------------------

    @property
    def modules(self) -> list[nn.Module]:
        """The segments this rank holds, by chunk."""
        return self.runtime.modules

    def train(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[float]:
        """Train on `batches` (each `(inputs, targets)`, this rank's local batch); yield losses.

        The program covers `num_batches` optimizer steps; batches are taken that many at a time.

        Raises:
            ValueError: a batch does not split into `m` equal microbatches, the batches run out
                in the middle of a program, or a shape differs from the first batch's.
            RankFailure: a peer failed or a wait timed out.
        """
        per_run = self.program.schedule.num_batches
        stream = iter(batches)
        while True:
            group = list(islice(stream, per_run))
            if not group:
                return
            if len(group) < per_run:
                raise ValueError(
                    f"the program covers {per_run} batches per run but only {len(group)} were "
                    "left; pass a multiple of num_batches"
                )
            yield from self._run(group)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on one batch (schedules with `num_batches == 1`); its loss."""
        if self.program.schedule.num_batches != 1:
            raise ScheduleConfigError(
                "train_step needs a program with num_batches=1; use train(batches) instead"
            )
        (loss,) = self._run([(inputs, targets)])
        return loss

    def trace_events(self, run: int = -1) -> list[tuple[int, Instruction, float, float]]:
        """`(stage, instruction, start, end)` per instruction of run `run` (seconds)."""
        ops = self.program.stages[self.stage]
        events = []
        for (lo, hi), (start, end) in zip(self._bounds, self.step_times[run]):
            events.extend((self.stage, ops[pos], start, end) for pos in range(lo, hi))
        return events

    # -- one run of the program -----------------------------------------------------------------

    def _run(self, group: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        runtime = self.runtime
        m = self.program.schedule.num_microbatches
        split = [(_split(x, m, self.device), _split(y, m, self.device)) for x, y in group]
        if not self._learnt:
            self._learn_shapes(split[0][0])
            self._learnt = True
        runtime.reset()
        for batch, (inputs, targets) in enumerate(split):
            runtime.load_batch(batch, inputs, targets)
        times: list[tuple[float, float]] = []
        clock = time.perf_counter
        self._posted.clear()
        for index, step in enumerate(self._steps):
            self._at = index
            start = clock()
            if type(step) is _Group:
                self._exchange(index, step)
            elif step.group == "update":
                self._update(step)
            else:
                runtime.run(step)
            times.append((start - self._clock0, clock() - self._clock0))
        self._at = None
        self._finish_sends()
        self.step_times.append(times)
        self.steps += len(group)
        return self._losses(len(group))

    # -- checkpoints (collective: every rank of the default group calls them) ------------------

    def save(self, path) -> None:
        """Write this rank's shard of a checkpoint to the directory `path`.

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

    def load(self, path) -> None:
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

    def _exchange(self, index: int, step: _Group) -> None:
        if not self._early:
            self._exchange_batched(step)
            return
        tensors = [self._outgoing(op, key) for op, _, key in step.sends]
        try:
            received = self._posted.pop(index, None)
            if received is None:
                received = self._post_recvs(step)
            for (_, peer, _), tensor in zip(step.sends, tensors):
                work = dist.isend(tensor, group=self.pp_group, group_dst=peer)
                self._sending.append((work, tensor, step))  # see [Note: sends complete lazily]
            ahead = self._next_recv[index]
            if ahead is not None and ahead not in self._posted:
                self._posted[ahead] = self._post_recvs(self._steps[ahead])  # type: ignore[arg-type]
            for _, _, work in received:
                work.wait(self.timeout)
        except RuntimeError as exc:
            raise RankFailure(self._failure(step, exc)) from exc
        for op, buffer, _ in received:
            self.runtime.incoming(op, buffer)

    def _post_recvs(self, step: _Group) -> list[tuple[Instruction, torch.Tensor, object]]:
        posted = []
        for op, peer, key in step.recvs:
            shape, dtype = self._shapes[key]
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            posted.append((op, buffer, dist.irecv(buffer, group=self.pp_group, group_src=peer)))
        return posted

    def _outgoing(self, op: Instruction, key: tuple[str, int]) -> torch.Tensor:
        tensor = self.runtime.outgoing(op)
        if tuple(tensor.shape) != self._shapes[key][0]:
            raise ValueError(_shape_changed(op, tensor, self._shapes[key][0]))
        return tensor

    def _exchange_batched(self, step: _Group) -> None:
        """The group as one `batch_isend_irecv` (NCCL: a coalesced batch, waited whole)."""
        runtime, shapes, device = self.runtime, self._shapes, self.device
        ops, received = [], []
        for op, is_send, peer, key in step.items:
            if is_send:
                tensor = self._outgoing(op, key)
                ops.append(dist.P2POp(dist.isend, tensor, self._global_peer[peer], self.pp_group))
            else:
                shape, dtype = shapes[key]
                buffer = torch.empty(shape, dtype=dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, buffer, self._global_peer[peer], self.pp_group))
                received.append((op, buffer))
        try:
            works = dist.batch_isend_irecv(ops)
            if len(works) != len(ops):  # coalesced (NCCL): one handle for the whole group
                for work in works:
                    work.wait(self.timeout)
            else:
                for work, p2p in zip(works, ops):
                    if p2p.op is dist.isend:  # see [Note: sends complete lazily]
                        self._sending.append((work, p2p.tensor, step))
                    else:
                        work.wait(self.timeout)
        except RuntimeError as exc:
            raise RankFailure(self._failure(step, exc)) from exc
        for op, buffer in received:
            runtime.incoming(op, buffer)

    def _finish_sends(self) -> None:
        sending, self._sending = self._sending, []
        for work, _tensor, step in sending:
            try:
                work.wait(self.timeout)
            except RuntimeError as exc:
                raise RankFailure(self._failure(step, exc)) from exc

    def _update(self, op: Instruction) -> None:
        try:
            self.runtime.run(op)
        except RuntimeError as exc:
            if self.data_parallel.size == 1:
                raise
            ranks = dist.get_process_group_ranks(self.dp_group)
            raise RankFailure(
                f"rank {self.rank} (stage {self.stage}) failed at {op}, a collective over the "
                f"data-parallel ranks {ranks}: {_first_line(exc)}"
            ) from exc

    def _failure(self, step: _Group, exc: BaseException) -> str:
        ops = " ".join(str(op) for op, *_ in step.items)
        peers = ", ".join(f"rank {self._global_peer[s]} (stage {s})" for s in step.peers)
        return (
            f"rank {self.rank} (stage {self.stage}) failed waiting at comm group [{ops}] on "
            f"{peers}: {_first_line(exc)}"
        )

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

    # -- the shape pass (see the note at the top) -----------------------------------------------

    def _learn_shapes(self, first_inputs: Sequence[torch.Tensor] | None) -> None:
        layout, me = self._layout, self.stage
        dist.barrier(group=self.pp_group)
        devices = [self.device] if self.device.type == "cuda" else []
        held: torch.Tensor | None = None
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for k in range(layout.last):
                producer, consumer = layout.stage_of[k], layout.stage_of[k + 1]
                if producer == me:
                    if k == 0:
                        if not first_inputs:
                            raise ValueError(f"stage {me} holds segment 0 but got no inputs")
                        held = first_inputs[0]
                    held = self.runtime.modules[layout.chunk_of[k]](held)
                    if consumer != me:
                        self._send_tensor(held, consumer)
                elif consumer == me:
                    held = self._recv_tensor(producer)
                if me in (producer, consumer):
                    self._shapes["A", k] = (tuple(held.shape), held.dtype)
        dist.barrier(group=self.pp_group)
        self._clock0 = time.perf_counter()

    def _send_tensor(self, tensor: torch.Tensor, stage: int) -> None:
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise ValueError(
                f"stage {self.stage} sends a {tensor.dim()}-d {tensor.dtype} activation; the "
                f"distributed backend moves tensors of up to {_MAX_DIMS} dims of {_DTYPES}"
            )
        meta = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        meta += [0] * (2 + _MAX_DIMS - len(meta))
        peer = self._global_peer[stage]
        dist.send(torch.tensor(meta, dtype=torch.int64, device=self.device), peer, self.pp_group)
        dist.send(tensor.contiguous(), peer, self.pp_group)

    def _recv_tensor(self, stage: int) -> torch.Tensor:
        peer = self._global_peer[stage]
        meta = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        dist.recv(meta, peer, self.pp_group)
        code, ndim, *dims = meta.tolist()
        tensor = torch.empty(dims[:ndim], dtype=_DTYPES[code], device=self.device)
        dist.recv(tensor, peer, self.pp_group)
        return tensor

    @property
    def current_instruction(self) -> str | None:
        """What this rank is executing or waiting on now (for watchdogs and error messages)."""
        if self._at is None:
            return None
        lo, hi = self._bounds[self._at]
        return " ".join(str(op) for op in self.program.stages[self.stage][lo:hi])


# -- setup helpers ---------------------------------------------------------------------------------


def _groups(program: Program, mesh, pp_group, dp_group):
    p, dp = program.num_stages, program.data_parallel
    if (pp_group is None) != (dp_group is None):
        raise ScheduleConfigError("pass both pp_group and dp_group, or neither")
    if pp_group is None:
        if mesh is None:
            world = dist.get_world_size()
            if world != p * dp:
                raise ScheduleConfigError(
                    f"the world has {world} rank(s) but the program needs p * data_parallel = "
                    f"{p} * {dp} = {p * dp}"
                )
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device_type, (dp, p), mesh_dim_names=("dp", "pp"))
        if tuple(mesh.mesh_dim_names or ()) != ("dp", "pp"):
            raise ScheduleConfigError(
                f"the mesh must have dims ('dp', 'pp'), got {mesh.mesh_dim_names}"
            )
        pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    if dist.get_world_size(pp_group) != p or dist.get_world_size(dp_group) != dp:
        raise ScheduleConfigError(
            f"the pipeline group has {dist.get_world_size(pp_group)} rank(s) and the "
            f"data-parallel group {dist.get_world_size(dp_group)}; the program needs p={p} and "
            f"data_parallel={dp}"
        )
    return pp_group, dp_group


def _own_segments(schedule, stage: int, segments: Sequence[nn.Module]) -> list[nn.Module]:
    segments = list(segments)
    v = schedule.num_chunks
    if len(segments) == schedule.num_segments:
        return [segments[schedule.segment_of(stage, c)] for c in range(v)]
    if len(segments) == v:
        return segments
    raise ScheduleConfigError(
        f"got {len(segments)} segment(s): pass all p*v = {schedule.num_segments} segments of the "
        f"model, or this stage's {v} by chunk"
    )


def _device_of(modules: Sequence[nn.Module]) -> torch.device:
    for module in modules:
        for tensor in module.parameters():
            return tensor.device
    return torch.device("cpu")


def _plan(program: Program, stage: int, layout: Layout) -> list[Instruction | _Group]:
    """The stage's program as steps: single compute/update instructions and comm groups."""
    ops = program.stages[stage]
    steps: list[Instruction | _Group] = []
    for lo, hi in Steps.of([ops]).bounds[0]:
        if ops[lo].group != "comm":
            steps.append(ops[lo])
            continue
        items = []
        for op in ops[lo:hi]:
            src, dst, (kind, _, k) = comm_route(layout, stage, op)  # type: ignore[misc]
            # the tensor is an activation out of segment k, or the gradient of the activation
            # out of segment k - 1: either way its shape is learnt under ("A", segment)
            key = ("A", k if kind == "A" else k - 1)
            items.append((op, op.is_send, dst if op.is_send else src, key))
        steps.append(_Group(items))
    return steps


def _next_receiving(steps: Sequence[Instruction | _Group]) -> list[int | None]:
    """Per step, the index of the first later step that receives (None: none is left)."""
    ahead: list[int | None] = [None] * len(steps)
    following = None
    for index in range(len(steps) - 1, -1, -1):
        ahead[index] = following
        step = steps[index]
        if type(step) is _Group and step.recvs:
            following = index
    return ahead


def _split(tensor: torch.Tensor | None, m: int, device: torch.device):
    if tensor is None:
        return None
    if tensor.shape[0] % m:
        raise ValueError(
            f"a batch of {tensor.shape[0]} does not split into {m} equal microbatches; the "
            "distributed backend needs batch size divisible by num_microbatches"
        )
    return [part.to(device) for part in tensor.chunk(m)]


def _shape_changed(op, tensor, expected) -> str:
    return (
        f"{op} sends shape {tuple(tensor.shape)} but the first batch's was {expected}; the "
        "distributed backend learns shapes once: keep every batch the same size"
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    text = text.splitlines()[0]
    return text.split(". This is typically", 1)[0]  # gloo's generic advice
