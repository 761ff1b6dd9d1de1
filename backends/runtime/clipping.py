"""What `GradNorm` does on a stage: the whole model's gradient norm, clipping by it, skipping a
step whose gradients are not finite, and float16's dynamic loss scale.

[Note: one norm, every stage alike] A `GradNorm` runs after the batch's gradients are final on
its stage (summed over tied copies, reduced over data-parallel replicas, divided by a
`(loss_sum, count)` loss's count). Each stage measures its part, the sum of its gradients'
squares in float64: every parameter it trains once, but a tied parameter only on its first
copy (after `ReduceTied` every copy holds the same sum, and `clip_grad_norm_` on the
non-pipelined model counts the one parameter once), and under ZeRO only this replica's shard
(the replicas then sum their parts; without ZeRO every replica holds the whole reduced gradient
and adds nothing). The parts are summed over the stages in stage order, so every rank of every
replica gets the same total and takes the same decision: clip by `min(1, max_norm / (norm +
1e-6))` as `torch.nn.utils.clip_grad_norm_` does, or, when the norm is not finite, skip the step
(gradients dropped, weights and optimizer state unchanged). Under float16 the gradients are first
unscaled, and the loss scale halves on a skipped step and doubles after `growth_interval`
finite ones, on every rank alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from schedcc.backends.runtime.syncs import host_read

if TYPE_CHECKING:
    from schedcc.backends.runtime.collectives import Collectives

__all__ = ["LossScaler", "NormMeeting", "StageNorm", "shard_mask"]


class LossScaler:
    """The dynamic loss scale of float16 training (as `torch.amp.GradScaler`'s defaults)."""

    def __init__(
        self, scale: float = 2.0**16, *, factor: float = 2.0, growth_interval: int = 2000
    ) -> None:
        self.scale = scale
        self.factor = factor
        self.growth_interval = growth_interval
        self._good = 0

    def update(self, finite: bool) -> None:
        """After a step's norm: halve the scale on overflow, double it after enough good ones."""
        if not finite:
            self.scale /= self.factor
            self._good = 0
            return
        self._good += 1
        if self._good >= self.growth_interval:
            self.scale *= self.factor
            self._good = 0

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint keeps: the scale and the finite steps since it last changed."""
        return {"scale": self.scale, "good": self._good}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self._good = float(state["scale"]), int(state["good"])


class StageNorm:
    """One stage's side of `GradNorm` ([Note: one norm, every stage alike]).

    Args:
        max_norm: clip to this norm (None: measure and skip non-finite steps only).
        scaler: float16's loss scaler, or None.
        views: what the stage trains, by chunk (the modules, or their `StageTies.views`).
        shards: under ZeRO, this rank's flat shard of each chunk (what the optimizer steps);
            None without ZeRO.
        numels: under ZeRO, per chunk, its parameters' whole sizes (a ZeRO-3 chunk's
            released parameters hold no data).
        collectives: the stage's data-parallel group (under ZeRO its parts are summed over it).
        later_copies: the ids of the tied copies here that are not a tie's first copy.
        tp_rank: this rank's index in its tensor-parallel group: a parameter not marked
            `tensor_model_parallel` (replicated) counts only on index 0.
        device: where the part is made.
    """

    def __init__(
        self,
        max_norm: float | None,
        scaler: LossScaler | None,
        *,
        views: Sequence[nn.Module],
        shards: Sequence[torch.Tensor] | None,
        numels: Sequence[Sequence[int]] = (),
        collectives: Collectives,
        later_copies: Iterable[int] = (),
        tp_rank: int = 0,
        device: torch.device,
    ) -> None:
        self.max_norm = max_norm
        self.scaler = scaler
        self._views = views
        self._shards = shards
        self._numels = numels
        self._collectives = collectives
        self._later_copies = later_copies
        self._tp_rank = tp_rank
        self._device = device
        #: the whole model's gradient norm at the last `GradNorm` (before clipping)
        self.last: float | None = None
        #: whether the next step is skipped (the last norm was not finite)
        self.skip = False

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """What the last segment backpropagates: under float16 the loss times the loss scale."""
        return loss if self.scaler is None else loss * self.scaler.scale

    def part(self) -> torch.Tensor:
        """This stage's part, once the batch's gradients are final: the gradients unscaled
        under float16, and the float64 sum of their squares (each parameter counted once over
        the model; under ZeRO this rank's shards, summed over the data-parallel replicas)."""
        measured = self._measured()
        if self.scaler is not None:
            inverse = 1.0 / self.scaler.scale
            for g in self._grads():
                g.mul_(inverse)
        total = torch.zeros((), dtype=torch.float64, device=self._device)
        for g, mask in measured:
            g = g.detach().to(torch.float64)
            if mask is not None:
                g = g * mask
            total = total + g.square().sum()
        if self._shards is not None and self._collectives.size > 1:
            self._collectives.all_reduce(total)
        return total

    def apply(self, total: torch.Tensor) -> None:
        """Given every stage's part summed: clip the gradients in place, or mark the step
        skipped."""
        (square,) = host_read(total.reshape(1))  # the decision needs it: [Note: host syncs]
        norm = math.sqrt(square) if square >= 0 else math.nan
        self.last = norm
        finite = math.isfinite(norm)
        if self.scaler is not None:
            self.scaler.update(finite)
        self.skip = not finite
        if finite and self.max_norm is not None:
            coef = min(1.0, self.max_norm / (norm + 1e-6))
            for g in self._grads():
                g.mul_(coef)

    def _grads(self) -> list[torch.Tensor]:
        """The gradients of what the optimizer steps (the shards under ZeRO)."""
        return [p.grad for p in self._stepped() if p.grad is not None]

    def _stepped(self) -> list[torch.Tensor]:
        if self._shards is not None:
            return list(self._shards)
        return [p for view in self._views for p in view.parameters()]

    def _measured(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The `(gradient, mask)` pairs the part sums (a 0/1 mask leaves elements out)."""
        skipped = set(self._later_copies)
        if self._tp_rank:  # replicated over the tensor-parallel group: counted on rank 0
            params = (p for view in self._views for p in view.parameters())
            skipped |= {id(p) for p in params if not getattr(p, "tensor_model_parallel", False)}
        if self._shards is None:
            return [
                (p.grad, None)
                for p in self._stepped()
                if p.grad is not None and id(p) not in skipped
            ]
        coll = self._collectives
        return [
            (
                shard.grad,
                shard_mask(
                    list(view.parameters()), numels, skipped, shard.numel(), coll.size, coll.rank
                ),
            )
            for view, numels, shard in zip(self._views, self._numels, self._shards, strict=True)
            if shard.grad is not None
        ]


def shard_mask(
    params: list[torch.nn.Parameter],
    numels: list[int],
    skipped: set[int],
    shard: int,
    size: int,
    rank: int,
) -> torch.Tensor | None:
    """The 0/1 mask of this rank's ZeRO shard of a chunk's flat gradient that leaves out the
    parameters in `skipped` (by id); None when nothing is left out. `numels` are the
    parameters' whole sizes (under ZeRO-3 a released parameter holds no data)."""
    if not any(id(p) in skipped for p in params):
        return None
    full = torch.ones(shard * size, dtype=torch.float64, device=params[0].device)
    offset = 0
    for p, n in zip(params, numels, strict=True):
        if id(p) in skipped:
            full[offset : offset + n] = 0.0
        offset += n
    return full[rank * shard : (rank + 1) * shard]


class NormMeeting:
    """Where the stages of one replica meet for `GradNorm` on the local backend: each posts its
    part, and once all have, each takes the sum in stage order (as the distributed backend adds
    them)."""

    def __init__(self, num_stages: int) -> None:
        self._num_stages = num_stages
        self._parts: dict[int, list[torch.Tensor | None]] = {}  # n-th GradNorm -> parts
        self._arrivals = [0] * num_stages
        self._taken: dict[int, int] = {}

    def post(self, stage: int, part: torch.Tensor) -> None:
        n = self._arrivals[stage]
        self._arrivals[stage] = n + 1
        self._parts.setdefault(n, [None] * self._num_stages)[stage] = part

    def take(self, stage: int) -> torch.Tensor | None:
        n = self._arrivals[stage] - 1
        parts = self._parts[n]
        if any(part is None for part in parts):
            return None
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part.to(total.device))
        self._taken[n] = self._taken.get(n, 0) + 1
        if self._taken[n] == self._num_stages:
            del self._parts[n], self._taken[n]
        return total
