"""How a stage's data-parallel replicas reduce and gather: the `Collectives` a runtime is given.

`StageRuntime` reduces gradients and gathers ZeRO shards only through a `Collectives` object over
its stage's data-parallel replicas. Three kinds exist: `SoloCollectives` (one replica: identities),
`ThreadCollectives` (replicas as threads of one process: the local backend) and the distributed
backend's `DataParallel` (a `torch.distributed` process group).

The gradient reduction launches its collectives asynchronously (`all_reduce_async`,
`reduce_scatter_async`: a `Work` to wait on; [Note: contiguous gradient buckets] in
`backends.runtime.zero`). The local backend's replicas sum at the launch, in rank order, and
hand back work that is already done, so the local engine stays the exact oracle.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "DONE",
    "Collectives",
    "Meeting",
    "SoloCollectives",
    "ThreadCollectives",
    "Work",
]

#: Seconds a replica thread waits for the others at a collective before giving up.
COLLECTIVE_TIMEOUT_S = 120.0


class Work(Protocol):
    """A launched collective: its result is there once `wait` returns."""

    def wait(self) -> None:
        """Block until the collective is done (on CUDA: until the current stream waits)."""


class _Done:
    """The `Work` of a collective that finished at its launch."""

    def wait(self) -> None:
        return None


#: Work that is already done.
DONE: Work = _Done()


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

    def all_reduce_async(self, tensor: torch.Tensor) -> Work:
        """Launch the in-place SUM of `tensor` across the ranks; `tensor` must not be touched
        until the work is waited."""

    def reduce_scatter_async(self, flat: torch.Tensor, start: int, stop: int) -> Work:
        """Launch the SUM across the ranks of the bucket `flat[start:stop]`, in place, where
        `flat` is `size` equal shards (rank r's: its r-th slice). Once waited, the part of the
        bucket inside this rank's shard holds the sum; the rest of the bucket holds anything."""

    def all_gather_async(self, full: torch.Tensor) -> Work:
        """Launch the all-gather, in place, of `full`'s `size` equal parts: this rank's part
        (its `rank`-th) is what it gives; once waited, every part holds that rank's."""


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

    def all_reduce_async(self, tensor: torch.Tensor) -> Work:
        return DONE

    def reduce_scatter_async(self, flat: torch.Tensor, start: int, stop: int) -> Work:
        return DONE

    def all_gather_async(self, full: torch.Tensor) -> Work:
        return DONE


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

    def all_reduce_async(self, tensor: torch.Tensor) -> Work:
        """The in-place sum, met now (the replicas reach their launches in the same order)."""
        self.all_reduce(tensor)
        return DONE

    def reduce_scatter_async(self, flat: torch.Tensor, start: int, stop: int) -> Work:
        """The whole bucket summed in place, met now."""
        self.all_reduce(flat[start:stop])
        return DONE

    def all_gather_async(self, full: torch.Tensor) -> Work:
        """Every replica's part gathered into `full`, met now."""
        part = full.numel() // self.size
        full.copy_(self.all_gather(full[self.rank * part : (self.rank + 1) * part]))
        return DONE
