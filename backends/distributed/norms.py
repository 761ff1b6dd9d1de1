"""The process group of `GradNorm` on the distributed backend: the stages of one replica.

Made collectively, like the tied groups (`backends.distributed.ties`): every rank of the world
constructs a `NormGroup` in the same order, and when the program holds a `GradNorm` each replica
gets a group of its own stages, apart from the pipeline group the point-to-point uses (a blocking
collective there could meet a send that the eager gloo path posted early). The parts are
gathered and added in stage order, so every stage gets the same sum, bitwise, as the local
backend adds it ([Note: one norm, every stage alike] in `backends.runtime.clipping`).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from schedcc.backends.distributed.groups import sum_in_rank_order
from schedcc.backends.distributed.transfers import first_line
from schedcc.errors import RankFailure
from schedcc.ir import GradNorm
from schedcc.program import Program

__all__ = ["NormGroup"]


class NormGroup:
    """This replica's stages as one process group, and the in-order sum over it."""

    def __init__(self, program: Program, stage: int, pp_group, *, timeout: timedelta) -> None:
        self.stage = stage
        self.group = None
        self.ranks: list[int] = []
        if not any(type(op) is GradNorm for ops in program.stages for op in ops):
            return
        mine = dist.get_process_group_ranks(pp_group)
        replicas: list = [None] * dist.get_world_size()
        dist.all_gather_object(replicas, mine)
        for replica in sorted({tuple(r) for r in replicas}):
            group = dist.new_group(list(replica), timeout=timeout)
            if replica == tuple(mine):
                self.group, self.ranks = group, list(replica)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum the scalar `tensor` over the replica's stages in place, in stage order."""
        if len(self.ranks) < 2:
            return
        try:
            sum_in_rank_order(tensor, self.group, len(self.ranks))
        except RuntimeError as exc:
            raise RankFailure(
                f"rank {dist.get_rank()} (stage {self.stage}) failed at GradNorm, a collective "
                f"over the pipeline's ranks {self.ranks}: {first_line(exc)}"
            ) from exc
