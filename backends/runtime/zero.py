"""Data-parallel gradient reduction for `StageRuntime`, and under ZeRO the flat shards.

Each chunk's gradients are flattened into one buffer in parameter order (a missing `.grad` counts
as zeros). Without ZeRO the buffer is all-reduced and copied back into the `.grad`s. Under ZeRO
the buffer is padded to `size * shard` and reduce-scattered into the `.grad` of this rank's flat
shard parameter (the one the optimizer steps); `gather` all-gathers the stepped shards back into
the module's parameters.

Under ZeRO-3 (`release=True`) the module's parameters hold no data between uses: `release`
points each one at an empty tensor (the Parameter objects stay, so autograd and the caller's
references see the same parameters), and `unshard` all-gathers the shards into one flat buffer
that the parameters (and, until the release, this rank's shard) view. The shapes are recorded
once, so sizes never depend on what is held.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from schedcc.backends.runtime.collectives import Collectives

__all__ = ["Reducer"]


class Reducer:
    """Reduces one stage's gradients over its data-parallel group, chunk by chunk.

    Args:
        modules: the stage's segments, by chunk.
        collectives: communication over the stage's data-parallel group.
        zero: keep a flat shard per chunk (`shards`) for the optimizer to step.
        release: ZeRO-3: the modules' parameters start released (see `release`).
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        collectives: Collectives,
        *,
        zero: bool,
        release: bool = False,
    ) -> None:
        self._modules = modules
        self._collectives = collectives
        self._zero = zero
        #: per chunk, the shapes of its parameters in `parameters()` order
        self.shapes = [[p.shape for p in mod.parameters()] for mod in modules]
        self.shards: list[nn.Parameter] = []
        if zero:
            self.shards = [self._make_shard(c) for c in range(len(modules))]
        self.whole = [True] * len(modules)
        if release:
            for c in range(len(modules)):
                self.release(c)

    def reduce(self, c: int) -> None:
        """Sum chunk c's gradients over the group (into this rank's shard under ZeRO)."""
        coll = self._collectives
        if not self._zero:
            flat = self._flat_grads(c, 0)
            coll.all_reduce(flat)
            self._unflatten_into_grads(c, flat)
            return
        shard = coll.reduce_scatter(self._flat_grads(c, self._shard_size(c) * coll.size))
        target = self.shards[c]
        if target.grad is None:
            target.grad = shard.detach().clone()
        else:
            target.grad.add_(shard)
        for p in self._modules[c].parameters():
            p.grad = None  # reduced: what accumulates next is new

    def gather(self, c: int) -> None:
        """Copy every rank's shard of chunk c, in rank order, into the module's parameters."""
        full = self._collectives.all_gather(self.shards[c].detach())
        offset = 0
        with torch.no_grad():
            for p in self._modules[c].parameters():
                n = p.numel()
                p.copy_(full[offset : offset + n].view_as(p))
                offset += n

    def unshard(self, c: int, full: torch.Tensor | None = None, *, alias: bool = True) -> None:
        """ZeRO-3: make chunk c's parameters whole again from every rank's shard (`full`: their
        rank-ordered concatenation, when the caller has it; else an all-gather). `alias`: the
        shard becomes its slice of the gathered buffer until the release (no second copy while
        whole), so the parameters and the shard must not be written meanwhile."""
        shard = self.shards[c]
        if full is None:
            full = self._collectives.all_gather(shard.detach())
        if alias:
            size, rank = shard.numel(), self._collectives.rank
            shard.data = full[rank * size : (rank + 1) * size]
        offset = 0
        for p, shape in zip(self._modules[c].parameters(), self.shapes[c]):
            n = shape.numel()
            p.data = full[offset : offset + n].view(shape)
            offset += n
        self.whole[c] = True

    def release(self, c: int) -> None:
        """ZeRO-3: drop chunk c's whole parameters; this rank keeps only its shard."""
        if self.whole[c] and self.shards:
            self.shards[c].data = self.shards[c].data.clone()  # out of the gathered buffer
        for p in self._modules[c].parameters():
            p.data = p.data.new_empty(0)
        self.whole[c] = False

    def unshard_all(self, full: Sequence[torch.Tensor] | None = None) -> None:
        """ZeRO-3, between runs: make every chunk's parameters whole (`full[c]`: chunk c's
        shards of every rank concatenated in rank order, when the caller has them; else an
        all-gather each). The shard keeps its own copy: writes to the parameters are not kept."""
        for c in range(len(self._modules)):
            self.unshard(c, None if full is None else full[c], alias=False)

    def release_all(self) -> None:
        """ZeRO-3, between runs: release every chunk's whole parameters again."""
        for c in range(len(self._modules)):
            self.release(c)

    @contextmanager
    def placeholders(self) -> Iterator[None]:
        """Released chunks get whole-shaped (uninitialised) parameters for the duration, and
        are released again after; what is written into them meanwhile is lost unless copied
        into the shards (`refresh_shards`)."""
        released = [c for c, whole in enumerate(self.whole) if not whole]
        for c in released:
            for p, shape in zip(self._modules[c].parameters(), self.shapes[c]):
                p.data = p.data.new_empty(shape)
            self.whole[c] = True
        try:
            yield
        finally:
            for c in released:
                self.release(c)

    def refresh_shards(self) -> None:
        """Set each shard from the module's parameters (after loading new weights)."""
        with torch.no_grad():
            for c, shard in enumerate(self.shards):
                size, rank = shard.numel(), self._collectives.rank
                flat = self._flat_params(c, size * self._collectives.size)
                shard.copy_(flat[rank * size : (rank + 1) * size])

    def _flat_grads(self, c: int, length: int) -> torch.Tensor:
        params = list(self._modules[c].parameters())
        parts = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params
        ]
        flat = torch.cat(parts) if parts else torch.zeros(0)
        if length > flat.numel():
            flat = torch.cat([flat, flat.new_zeros(length - flat.numel())])
        return flat

    def _numel(self, c: int) -> int:
        return sum(shape.numel() for shape in self.shapes[c])

    def _shard_size(self, c: int) -> int:
        return max(1, math.ceil(self._numel(c) / self._collectives.size))

    def _make_shard(self, c: int) -> nn.Parameter:
        size = self._shard_size(c)
        rank = self._collectives.rank
        with torch.no_grad():
            flat = self._flat_params(c, size * self._collectives.size)
            return nn.Parameter(flat[rank * size : (rank + 1) * size].clone())

    def _flat_params(self, c: int, length: int) -> torch.Tensor:
        params = list(self._modules[c].parameters())
        flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)
        return torch.cat([flat, flat.new_zeros(length - flat.numel())])

    def _unflatten_into_grads(self, c: int, flat: torch.Tensor) -> None:
        offset = 0
        for p in self._modules[c].parameters():
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n
