"""`StageState`: what one stage keeps between runs of the program, for `StageRuntime`.

A checkpoint keeps, per data-parallel rank of a stage, what `StageState.state_dict` returns
(`backends.checkpoint.state`); `load_state_dict` restores it from every old rank's state, checked
whole first (`backends.checkpoint.restore`), so that a load never fails half-way. Under ZeRO-3
the modules hold only their shards between runs; `unshard_all` and `release_all` make the
parameters whole for a save or an export, and release them again (`backends.runtime.zero`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from schedcc.backends.checkpoint.restore import check_saved, load_stage
from schedcc.backends.checkpoint.sharded import whole_states
from schedcc.backends.checkpoint.state import stage_state

if TYPE_CHECKING:
    from schedcc.backends.runtime.clipping import LossScaler
    from schedcc.backends.runtime.collectives import Collectives
    from schedcc.backends.runtime.tied import StageTies
    from schedcc.backends.runtime.zero import Reducer
    from schedcc.program import Program

__all__ = ["StageState"]


class StageState:
    """One stage's modules, optimizer, loss scale, learning-rate schedule and skipped steps, as
    a checkpoint saves and restores them.

    Args:
        program: the compiled program (its schedule names the stage's segments).
        stage: which stage this is.
        modules: the stage's segments, by chunk.
        optimizer: the stage's optimizer (None for a stage without parameters).
        reducer: the stage's gradient reduction and ZeRO shards (`backends.runtime.zero`).
        ties: the tied parameters the stage holds (None for none).
        scaler: float16's loss scale (None otherwise).
        lr_scheduler: the optimizer's learning-rate schedule (None for none).
        collectives: the stage's data-parallel group.
    """

    def __init__(
        self,
        program: Program,
        stage: int,
        modules: Sequence[nn.Module],
        optimizer: torch.optim.Optimizer | None,
        reducer: Reducer,
        *,
        ties: StageTies | None,
        scaler: LossScaler | None,
        lr_scheduler: Any,
        collectives: Collectives,
    ) -> None:
        self.program, self.stage, self.modules = program, stage, modules
        self.optimizer, self.lr_scheduler, self.collectives = optimizer, lr_scheduler, collectives
        self._reducer, self._ties, self._scaler = reducer, ties, scaler
        schedule = program.schedule
        self._segments = [schedule.segment_of(stage, c) for c in range(schedule.num_chunks)]
        #: steps skipped because the gradients were not finite
        self.skipped_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this stage between runs (`backends.checkpoint.state`)."""
        scaler = self._scaler
        return stage_state(
            self.modules,
            self.optimizer,
            self._reducer,
            stage=self.stage,
            segments=self._segments,
            zero=self.program.zero,
            rank=self.collectives.rank,
            size=self.collectives.size,
            skipped_steps=self.skipped_steps,
            loss_scale=scaler.state_dict() if scaler is not None else None,
            lr_scheduler=self.lr_scheduler,
        )

    def tensor_kinds(self) -> list[dict[str, tuple[torch.Size, torch.dtype]]]:
        """Per chunk, each tensor of its module state's whole shape and dtype (under ZeRO-3
        too, where the modules hold only shards between runs)."""
        with self._reducer.placeholders():
            return [
                {
                    key: (value.shape, value.dtype)
                    for key, value in module.state_dict().items()
                    if isinstance(value, torch.Tensor)
                }
                for module in self.modules
            ]

    def check_state(self, saved: Sequence[dict[str, Any]]) -> None:
        """Raise `CheckpointError` unless `saved` (every old rank's state, in rank order) fits
        whole, so that `load_state_dict` cannot fail half-way; nothing is changed."""
        with self._reducer.placeholders():  # ZeRO-3: checked against the whole shapes
            check_saved(self, saved)

    def load_state_dict(self, saved: Sequence[dict[str, Any]]) -> None:
        """Restore from every old data-parallel rank's state of this stage (in rank order).

        The old layout may differ in data-parallel degree or ZeRO: the optimizer state is
        re-sharded (exact for elementwise optimizers such as SGD and Adam).
        """
        self.check_state(saved)
        saved = whole_states(saved)
        coll = self.collectives
        load_stage(
            saved,
            self.modules,
            self.optimizer,
            self._reducer,
            ties=self._ties,
            scaler=self._scaler,
            lr_scheduler=self.lr_scheduler,
            zero=self.program.zero,
            rank=coll.rank,
            size=coll.size,
        )
        self.skipped_steps = saved[0]["skipped_steps"]

    # -- ZeRO-3 between runs ---------------------------------------------------------------------

    @property
    def shards(self) -> list[torch.Tensor]:
        """Under ZeRO, this rank's flat shard of each chunk's parameters (what the optimizer
        steps); empty otherwise."""
        return [shard.detach() for shard in self._reducer.shards]

    def unshard_all(self, full: Sequence[torch.Tensor] | None = None) -> None:
        """ZeRO-3: make every chunk's parameters whole (`full[c]`: chunk c's shards of every
        rank concatenated in rank order, when the caller has them; `Reducer.unshard_all`)."""
        self._reducer.unshard_all(full)

    def release_all(self) -> None:
        """ZeRO-3: release every chunk's whole parameters again (only the shards stay)."""
        self._reducer.release_all()
