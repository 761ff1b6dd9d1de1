"""How a stage's data-parallel replicas reduce and gather: the `Collectives` a runtime is given.

`StageRuntime` reduces gradients and gathers ZeRO shards only through a `Collectives` object over
its stage's data-parallel replicas. Three kinds exist: `SoloCollectives` (one replica: identities),
`ThreadCollectives` (replicas as threads of one process: the local backend) and the distributed
backend's `DataParallel` (a `torch.distributed` process group).
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

__all__ = ["COLLECTIVE_TIMEOUT_S", "Collectives", "Meeting", "SoloCollectives", "ThreadCollectives"]

#: Seconds a replica thread waits for the others at a collective before giving up.
COLLECTIVE_TIMEOUT_S = 120.0


class Collectives(Protocol):
    """Data-parallel communication over one stage's replicas, supplied by the backend."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """In-place SUM across the data-parallel ranks."""

    def reduce_scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """SUM of `flat` (length `size * shard`) across ranks; returns this rank's shard."""

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The concatenation, in rank order, of every rank's `shard` (flat)."""


class SoloCollectives:
    """The collectives of a single replica (data_parallel == 1): identities."""

    rank = 0
    size = 1

    def all_reduce(self, tensor: torch.Tensor) -> None:
        return None

    def reduce_scatter(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.clone()

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        return shard.clone()


class Meeting:
    """Where one stage's replica threads meet for a collective: a slot each and a barrier."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=COLLECTIVE_TIMEOUT_S)


class ThreadCollectives:
    """`Collectives` between replica threads of one process: sums in rank order (deterministic)."""

    def __init__(self, meeting: Meeting, rank: int) -> None:
        self._meeting = meeting
        self.rank = rank
        self.size = meeting.size

    def _swap(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every replica's `tensor`, in rank order."""
        meeting = self._meeting
        meeting.slots[self.rank] = tensor
        meeting.barrier.wait()
        seen = list(meeting.slots)  # type: ignore[arg-type]
        meeting.barrier.wait()  # nobody refills a slot before everyone has read them all
        return seen  # type: ignore[return-value]

    def _sum(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self._swap(tensor.detach().clone())
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
        return torch.cat(self._swap(shard.detach().clone()))
