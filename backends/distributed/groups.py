"""Setting up the distributed `Engine`: process groups, this stage's segments, its program.

`process_groups` makes the pipeline and data-parallel process groups (over a default mesh in
the `rank_order` asked for: see [Note: rank layout]), `bound_waits` gives the ones the engine
made its timeout, and `DataParallel` runs the runtime's collectives over one. `own_segments`
takes or builds this stage's segments, and `check_backend` refuses CUDA tensors on a gloo group.

[Note: rank layout] A default mesh lays the world out in one of two orders (`RANK_ORDERS`):

- "pp-inner" (the default): the stages of a pipeline are consecutive ranks, global rank
  `dp_index * p + stage` (`(..) * tp + tp_index` with tensor parallelism, tp innermost). With 8
  GPUs a node and `p * tp <= 8`, each pipeline stays on one node, so its point-to-point (every
  microbatch, both ways, on the critical path) runs over NVLink or shared memory, and only the
  data-parallel reductions (once a step, overlapped with the backward) cross nodes. Under gloo it
  is what lets neighbouring stages exchange through shared memory.
- "dp-inner": Megatron-LM's order (tp-cp-ep-dp-pp, tp innermost): global rank
  `stage * dp + dp_index` (`(..) * tp + tp_index`). A stage's data-parallel peers are
  consecutive, so the gradient all-reduce (the largest collective for big `dp` and a large
  stage) stays within a node and the pipeline crosses nodes between stages. Choose it when
  gradient reduction, not activation traffic, is what a step waits on.

| dp=2 p=2  | pipelines (pp groups) | data-parallel groups |
|-----------|-----------------------|----------------------|
| pp-inner  | [0, 1] [2, 3]         | [0, 2] [1, 3]        |
| dp-inner  | [0, 2] [1, 3]         | [0, 1] [2, 3]        |

`stage_ops` gives the stage's program as the engine runs it, one item per unit of the rendezvous
model: single compute and update instructions, and each comm group as one `CommGroup` (its ops
posted and waited one by one around the computes on every transport, see [Note: eager
point-to-point]).

Each comm op moves one message on a *channel*: `("A", k)` the activations out of segment k,
`("G", k)` the input gradients out of segment k, and `("C", k)` those of them that carry their
batch's count ([Note: the count divides at the step] in `backends.runtime.losses`). A message is
compared with an earlier one of its channel to decide whether it needs a header
(`backends.distributed.streams`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from schedcc.backends.engine import build_segments, check_segments, is_builder
from schedcc.backends.runtime.collectives import DONE, Work
from schedcc.backends.runtime.losses import count_carriers
from schedcc.backends.runtime.syncs import WATCHDOG_GRACE_S
from schedcc.errors import ScheduleConfigError
from schedcc.ir import Instruction
from schedcc.program import Program
from schedcc.semantics import Layout, Units, comm_route, decode

__all__ = [
    "RANK_ORDERS",
    "Channel",
    "CommGroup",
    "DataParallel",
    "Groups",
    "bound_waits",
    "check_backend",
    "default_mesh",
    "device_of",
    "own_segments",
    "process_groups",
    "stage_ops",
    "tensor_group",
]

#: The orders a default mesh lays the ranks out in ([Note: rank layout]), by mesh dims.
RANK_ORDERS = {"pp-inner": ("dp", "pp"), "dp-inner": ("pp", "dp")}

#: `(kind, segment)`: "A" activations out of the segment, "G" its input gradients, "C" those of
#: them that carry a batch's count.
Channel = tuple[str, int]


@dataclass(frozen=True)
class Groups:
    """Process groups the caller made, for `Engine(..., groups=Groups(pp=..., dp=...))` in place
    of a `DeviceMesh` (e.g. Megatron's mpu groups): the rank's index in `pp` is its stage, `dp`
    joins the ranks holding the same stage (a group of one without data parallelism), and `tp`,
    when given, the ranks of one tensor-parallel stage (`pp` then joins one tensor-parallel
    index of every stage)."""

    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    tp: dist.ProcessGroup | None = None


class CommGroup:
    """One comm group of the program, ready to post.

    `items` are `(op, is_send, peer stage, channel)` in program order; `sends` and `recvs` the
    same split by direction.
    """

    __slots__ = ("items", "peers", "recvs", "sends")

    def __init__(self, items: list[tuple[Instruction, bool, int, Channel]]):
        self.items = items
        self.peers = sorted({peer for _, _, peer, _ in items})
        self.sends = [(op, peer, key) for op, is_send, peer, key in items if is_send]
        self.recvs = [(op, peer, key) for op, is_send, peer, key in items if not is_send]


def process_groups(program: Program, groups=None, rank_order: str | None = None):
    """The (pipeline, data-parallel) process groups: a `Groups`'s, a mesh's (the caller's, or
    a default one over the world in `rank_order`, see [Note: rank layout])."""
    p, dp = program.num_stages, program.data_parallel
    if rank_order is not None and groups is not None:
        raise ScheduleConfigError(
            f"rank_order={rank_order!r} lays out the default mesh; groups passed in (a mesh or "
            "Groups) bring their own order: pass one or the other"
        )
    if isinstance(groups, Groups):
        pp_group, dp_group = groups.pp, groups.dp
    else:
        mesh = groups
        if mesh is None:
            world = dist.get_world_size()
            if world != p * dp:
                raise ScheduleConfigError(
                    f"the world has {world} rank(s) but the program needs p * data_parallel = "
                    f"{p} * {dp} = {p * dp}"
                )
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
            mesh = default_mesh(device_type, p, dp, rank_order=rank_order)
        if not hasattr(mesh, "get_group"):
            raise ScheduleConfigError(
                f"groups= takes a DeviceMesh or a schedcc Groups(pp=..., dp=...), got "
                f"{type(mesh).__name__}"
            )
        names = tuple(mesh.mesh_dim_names or ())
        if names not in [(*dims, *tp) for dims in RANK_ORDERS.values() for tp in ((), ("tp",))]:
            raise ScheduleConfigError(
                "the mesh must have dims ('dp', 'pp') or ('pp', 'dp'), and 'tp' last for "
                f"tensor parallelism, got {mesh.mesh_dim_names}"
            )
        pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    if dist.get_world_size(pp_group) != p or dist.get_world_size(dp_group) != dp:
        raise ScheduleConfigError(
            f"the pipeline group has {dist.get_world_size(pp_group)} rank(s) and the "
            f"data-parallel group {dist.get_world_size(dp_group)}; the program needs p={p} and "
            f"data_parallel={dp}"
        )
    return pp_group, dp_group


def default_mesh(device_type: str, p: int, dp: int, tp: int = 1, *, rank_order=None):
    """A `DeviceMesh` over the world with dims "dp" and "pp" in `rank_order` (default
    "pp-inner"), and "tp" innermost when `tp > 1` ([Note: rank layout]).

    Raises:
        ScheduleConfigError: an unknown `rank_order`.
    """
    from torch.distributed.device_mesh import init_device_mesh

    order = "pp-inner" if rank_order is None else rank_order
    if order not in RANK_ORDERS:
        raise ScheduleConfigError(
            f"rank_order must be one of {', '.join(map(repr, RANK_ORDERS))}, got {rank_order!r}"
        )
    names = RANK_ORDERS[order]
    sizes = {"dp": dp, "pp": p}
    shape = tuple(sizes[name] for name in names)
    if tp > 1:
        names, shape = (*names, "tp"), (*shape, tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def check_backend(group, device: torch.device) -> None:
    """Refuse a gloo `group` for tensors on a CUDA `device` (gloo moves CPU tensors only).

    Raises:
        ScheduleConfigError: one line saying the fix.
    """
    backend = str(dist.get_backend(group))
    if device.type == "cuda" and backend == "gloo":
        raise ScheduleConfigError(
            f"the segments are on {device} but the pipeline's process group is gloo, which "
            'moves CPU tensors only: init with dist.init_process_group("nccl") (or '
            '"cpu:gloo,cuda:nccl"), or keep the segments on the CPU'
        )


def tensor_group(groups):
    """The tensor-parallel group: a `Groups`'s `tp`, a ("dp", "pp", "tp") mesh's "tp" group, or
    None (no tensor parallelism, or a group of one rank)."""
    if isinstance(groups, Groups):
        tp_group = groups.tp
    elif groups is not None and "tp" in (groups.mesh_dim_names or ()):
        tp_group = groups.get_group("tp")
    else:
        tp_group = None
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        return None
    return tp_group


def own_segments(schedule, stage: int, segments) -> list[nn.Module]:
    """The segments `stage` holds, by chunk: from all `p*v` segments, from its own `v`, or
    built by a builder for those alone ([Note: building only what a rank holds] in
    `backends.engine`)."""
    held = [schedule.segment_of(stage, c) for c in range(schedule.num_chunks)]
    if is_builder(segments):
        made = build_segments(schedule, segments, held)
        return [made[k] for k in held]
    segments = check_segments(schedule, segments, own_stage=True)
    if len(segments) == schedule.num_segments:
        return [segments[k] for k in held]
    return segments


def device_of(modules: Sequence[nn.Module]) -> torch.device:
    """The device of the first parameter (CPU for modules without parameters)."""
    for module in modules:
        for tensor in module.parameters():
            return tensor.device
    return torch.device("cpu")


def stage_ops(program: Program, stage: int, layout: Layout) -> list[Instruction | CommGroup]:
    """The stage's program as the engine runs it: compute/update instructions and comm groups."""
    ops = program.stages[stage]
    units = Units.of([ops])
    carriers = set(count_carriers(program, layout).values())
    items: list[Instruction | CommGroup] = []
    for (lo, hi), is_group in zip(units.bounds[0], units.is_group[0]):
        if not is_group:
            items.append(ops[lo])
            continue
        comms = []
        for op in ops[lo:hi]:
            src, dst, tensor = comm_route(layout, stage, op)  # type: ignore[misc]
            is_gradient, i, k = decode(tensor, layout.num_segments)
            kind = ("C" if i in carriers else "G") if is_gradient else "A"
            comms.append((op, op.is_send, dst if op.is_send else src, (kind, k)))
        items.append(CommGroup(comms))
    return items


class DataParallel:
    """`Collectives` over one stage's data-parallel process group (see
    `backends.runtime.collectives`).

    Gloo has no reduce-scatter: there it all-reduces (a bucket in place, or a copy) and keeps
    this rank's slice. Elsewhere (NCCL) a bucket's reduce-scatter is a `reduce` of each rank's
    part of it to that rank, in place, as DeepSpeed's ZeRO-2 reduces each partition to its
    owner: a bucket cut at parameter boundaries need not split into equal parts.
    """

    def __init__(self, dp_group, *, timeout: timedelta | None = None):
        self.dp_group = dp_group
        self.rank = dist.get_rank(dp_group)
        self.size = dist.get_world_size(dp_group)
        self._native = dist.get_backend(dp_group) != "gloo"
        self._global = [dist.get_global_rank(dp_group, r) for r in range(self.size)]

    def all_reduce_async(self, tensor: torch.Tensor) -> Work:
        """Launch the in-place SUM over the group (the blocking `all_reduce`'s sums)."""
        if self.size == 1 or tensor.numel() == 0:
            return DONE
        return dist.all_reduce(tensor, group=self.dp_group, async_op=True)  # type: ignore[return-value]

    def reduce_scatter_async(self, flat: torch.Tensor, start: int, stop: int) -> Work:
        """Launch the SUM of the bucket `flat[start:stop]` (of `size` equal shards) so that this
        rank's part of it holds the sum once waited."""
        if self.size == 1 or stop <= start:
            return DONE
        if not self._native:
            return dist.all_reduce(flat[start:stop], group=self.dp_group, async_op=True)  # type: ignore[return-value]
        shard = flat.numel() // self.size
        works = []
        for r in range(start // shard, math.ceil(stop / shard)):
            lo, hi = max(start, r * shard), min(stop, (r + 1) * shard)
            dst = self._global[r]
            works.append(dist.reduce(flat[lo:hi], dst, group=self.dp_group, async_op=True))
        return _AllOf(works)

    def all_gather_async(self, full: torch.Tensor) -> Work:
        """Launch the in-place all-gather of `full`'s `size` equal parts (this rank's given)."""
        if self.size == 1:
            return DONE
        part = full.numel() // self.size
        mine = full[self.rank * part : (self.rank + 1) * part]
        if self._native:
            return dist.all_gather_into_tensor(full, mine, group=self.dp_group, async_op=True)  # type: ignore[return-value]
        parts = list(full.split(part))
        return dist.all_gather(parts, mine, group=self.dp_group, async_op=True)  # type: ignore[return-value]

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


class _AllOf:
    """The `Work` of several launched collectives."""

    def __init__(self, works) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()


def bound_waits(timeout: timedelta, *groups) -> None:
    """Give process groups the engine made the engine's timeout for every wait on them (see
    [Note: failures]); the default group, which a mesh dimension over the world reuses, keeps
    its own. An NCCL group takes `WATCHDOG_GRACE_S` more: its waits are stream waits, and the
    engine's own bounded wait for the GPU (`wait_device`) fires first, with its one line,
    before NCCL's watchdog ends the process without a word."""
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)  # as torchtitan does
    if set_timeout is None:
        return
    world = dist.group.WORLD.group_name  # type: ignore[union-attr]
    for group in groups:
        if group.group_name != world and dist.get_world_size(group) > 1:
            nccl = dist.get_backend(group) == "nccl"
            set_timeout(timeout + timedelta(seconds=WATCHDOG_GRACE_S if nccl else 0), group)


def sum_in_rank_order(tensor: torch.Tensor, group, size: int) -> None:
    """`tensor` summed over the `size` ranks of `group` in place, the parts added in rank order
    so every rank gets the same bits (an all-reduce may add them in any order)."""
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    tensor.copy_(total)
