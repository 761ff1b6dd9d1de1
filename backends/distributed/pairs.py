"""Point-to-point as broadcasts within two-rank groups (`Engine(..., p2p="broadcast")`).

[Note: broadcast pairs] DeepSpeed's first pipeline engine moved tensors between neighbouring
stages with `dist.broadcast` in a process group of just the two ranks, before send/recv existed
for it. Here that transport stands beside gloo's send/recv and shared memory, to be measured
(benchmarks/p2p_latency.py). A broadcast is a collective, so both ranks of a group must call
them in the same order; the gloo path (`GlooPeer`) sends on two tags per peer and posts receives
ahead, so one group per pair would not do. Each (sender stage, receiver stage, tag) gets its own
two-rank group instead: within one, the sender's broadcasts are its sends on that channel in
order and the receiver's are its receives in order, which pair up first with first exactly as
send/recv's FIFO channels do. The groups are made collectively, in the same order on every rank
of the world, for every replica and every pair of stages that exchange.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from schedcc.errors import ScheduleConfigError
from schedcc.program import Program
from schedcc.semantics import Layout

__all__ = ["P2P_MODES", "BroadcastPairs", "p2p_mode"]

#: What `Engine(..., p2p=...)` accepts.
P2P_MODES = ("shm", "gloo", "broadcast")
_TAGS = (0, 1)  # the tags `GlooPeer` uses


def p2p_mode(p2p: str | None, shared_memory: bool) -> tuple[bool, str]:
    """`(shared_memory, mode)` for the engine's `p2p` and `shared_memory` arguments.

    Raises:
        ScheduleConfigError: `p2p` is not one of `P2P_MODES`.
    """
    if p2p is None:
        return shared_memory, "shm" if shared_memory else "gloo"
    if p2p not in P2P_MODES:
        raise ScheduleConfigError(f"p2p must be one of {', '.join(P2P_MODES)}, got {p2p!r}")
    return p2p == "shm", p2p


class BroadcastPairs:
    """This rank's broadcast groups, by (sender stage, receiver stage, tag), with a `send` and
    `recv` that `GlooPeer` calls as it calls a process group's (group-local stage numbers)."""

    def __init__(self, program: Program, stage: int, pp_group, *, timeout: timedelta) -> None:
        self.stage = stage
        self._groups: dict[tuple[int, int, int], tuple[object, int]] = {}
        stage_of = Layout.of(program.schedule).stage_of
        edges = {(stage_of[k], stage_of[k + 1]) for k in range(len(stage_of) - 1)}
        pairs = sorted({pair for a, b in edges if a != b for pair in ((a, b), (b, a))})
        mine = dist.get_process_group_ranks(pp_group)
        replicas: list = [None] * dist.get_world_size()
        dist.all_gather_object(replicas, mine)
        for replica in sorted({tuple(r) for r in replicas}):
            for a, b in pairs:
                for tag in _TAGS:
                    group = dist.new_group(sorted({replica[a], replica[b]}), timeout=timeout)
                    if replica == tuple(mine) and stage in (a, b):
                        self._groups[a, b, tag] = (group, replica[a])

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int):
        group, source = self._groups[self.stage, peer, tag]
        return dist.broadcast(tensors[0], source, group=group, async_op=True)

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int):
        group, source = self._groups[peer, self.stage, tag]
        return dist.broadcast(tensors[0], source, group=group, async_op=True)
