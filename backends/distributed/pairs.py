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

from schedcc.backends.distributed.links import Links
from schedcc.errors import ScheduleConfigError
from schedcc.program import Program

_TAGS = (0, 1)  # the tags `GlooPeer` uses

__all__ = ["P2P_MODES", "BroadcastPairs", "p2p_mode"]

#: What `Engine(..., p2p=...)` accepts.
P2P_MODES = ("shm", "gloo", "broadcast", "nccl")


def p2p_mode(p2p: str | None, backend: str | None) -> str:
    """The transport for the engine's `p2p` on a pipeline group of `backend`: by default "nccl"
    under NCCL, "shm" otherwise (`backend` None: only the name is checked).

    Raises:
        ScheduleConfigError: `p2p` is not one of `P2P_MODES`, or a gloo transport under NCCL.
    """
    if p2p is not None and p2p not in P2P_MODES:
        raise ScheduleConfigError(f"p2p must be one of {', '.join(P2P_MODES)}, got {p2p!r}")
    if p2p is None:
        return "nccl" if backend == "nccl" else "shm"
    if backend == "nccl" and p2p != "nccl":
        raise ScheduleConfigError(
            f"p2p={p2p!r} moves tensors through gloo or shared memory; under nccl use the "
            "default p2p ('nccl')"
        )
    return p2p


class BroadcastPairs:
    """This rank's broadcast groups, by (sender stage, receiver stage, tag), with a `send` and
    `recv` that `GlooPeer` calls as it calls a process group's (group-local stage numbers)."""

    def __init__(self, program: Program, stage: int, pp_group, *, timeout: timedelta) -> None:
        self.stage = stage
        self._links = Links(program, stage, pp_group, timeout=timeout, lanes=_TAGS)

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int):
        group, source = self._links.get(self.stage, peer, tag, global_ranks=True)[:2]
        return dist.broadcast(tensors[0], source, group=group, async_op=True)

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int):
        group, source = self._links.get(peer, self.stage, tag, global_ranks=True)[:2]
        return dist.broadcast(tensors[0], source, group=group, async_op=True)
