"""Restoring a `StageRuntime` from a checkpoint: does the saved state fit, and its optimizer.

A checkpoint keeps, per data-parallel rank of a stage, what `StageRuntime.state_dict` returns. It
fits this stage when every old rank is there and the parameters have the same sizes; the
optimizer state is loaded as is when the layout (data-parallel degree, ZeRO) is the same, and
re-laid out through `backends.checkpoint.state` otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from schedcc.backends.checkpoint.state import canonical_optimizer_state, layout_optimizer_state
from schedcc.errors import CheckpointError

__all__ = ["check_saved", "load_optimizer"]


def check_saved(stage: int, modules: Sequence[nn.Module], saved: Sequence[dict[str, Any]]) -> None:
    """Raise `CheckpointError` unless `saved` (every old rank's state, in rank order) fits."""
    numels = [[p.numel() for p in mod.parameters()] for mod in modules]
    ranks = [state.get("rank") for state in saved]
    if ranks != list(range(len(saved))) or any(
        state.get("data_parallel") != len(saved) for state in saved
    ):
        raise CheckpointError(
            f"stage {stage}: the checkpoint's data-parallel shards are incomplete (ranks {ranks})"
        )
    if any(state.get("numels") != numels for state in saved):
        raise CheckpointError(
            f"stage {stage}: the checkpoint's parameters have sizes "
            f"{saved[0].get('numels')}, this model's {numels}: it was saved from another model"
        )


def load_optimizer(
    optimizer: torch.optim.Optimizer,
    saved: Sequence[dict[str, Any]],
    modules: Sequence[nn.Module],
    *,
    zero: bool,
    rank: int,
    size: int,
) -> None:
    """Load the optimizer state of `saved` into `optimizer`, re-sharded to (zero, rank, size)."""
    if saved[0]["zero"] == zero and len(saved) == size:
        optimizer.load_state_dict(saved[rank]["optimizer"])
        return
    numels = saved[0]["numels"]
    target = optimizer.state_dict()
    target["state"] = layout_optimizer_state(
        canonical_optimizer_state(saved, numels),
        numels,
        [[p.shape for p in mod.parameters()] for mod in modules],
        zero=zero,
        rank=rank,
        size=size,
    )
    for group, old in zip(target["param_groups"], saved[0]["optimizer"]["param_groups"]):
        group.update({key: value for key, value in old.items() if key != "params"})
    optimizer.load_state_dict(target)
