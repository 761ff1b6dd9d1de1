"""ZeRO-3 checkpoints: each rank saves only its shard of each chunk's parameters.

Under `zero=3` a rank holds its parameters only as one flat shard per chunk between runs, so its
checkpoint records `shards` (that flat shard, per chunk) and `shapes` (per chunk, each
parameter's name and shape in `parameters()` order) beside module states whose parameters are
empty. `whole_states` rebuilds from every old rank's shards (in rank order) the module states a
checkpoint of any other ZeRO setting holds, so that checking and loading (and re-sharding to
another data-parallel degree or ZeRO setting) read one layout; `shard_state` is what a rank
records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from schedcc.backends.checkpoint.files import shard_name
from schedcc.errors import CheckpointError

if TYPE_CHECKING:
    from schedcc.backends.runtime.zero import Reducer

__all__ = ["shard_state", "whole_states"]


def shard_state(modules: Sequence[nn.Module], reducer: Reducer) -> dict[str, Any]:
    """What a ZeRO-3 rank records of its parameters: per chunk, each parameter's element count
    (`numels`), this rank's flat shard (`shards`) and each parameter's name and shape
    (`shapes`)."""
    names = [[n for n, _ in mod.named_parameters()] for mod in modules]
    return {
        "numels": [[shape.numel() for shape in shapes] for shapes in reducer.shapes],
        "shards": [shard.detach().clone() for shard in reducer.shards],
        "shapes": [
            [(name, list(shape)) for name, shape in zip(chunk, shapes)]
            for chunk, shapes in zip(names, reducer.shapes)
        ],
    }


def whole_states(saved: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`saved` (every old rank's state of one stage, in rank order) with whole parameters in
    `modules`; unchanged unless it was saved under ZeRO-3.

    Raises:
        CheckpointError: a ZeRO-3 shard misses its `shards` or `shapes`, or they disagree.
    """
    if not saved or saved[0].get("zero") != 3:
        return list(saved)
    stage = saved[0].get("stage")
    for rank, state in enumerate(saved):
        shards, shapes = state.get("shards"), state.get("shapes")
        if not isinstance(shards, list) or not isinstance(shapes, list):
            raise CheckpointError(
                f"{shard_name(stage, rank)} was saved under zero=3 but records no parameter "
                "shards: it was altered"
            )
    shapes = saved[0]["shapes"]
    modules = []
    for c, named in enumerate(shapes):
        flat = torch.cat([state["shards"][c].reshape(-1) for state in saved])
        total = sum(torch.Size(shape).numel() for _, shape in named)
        if flat.numel() < total:
            raise CheckpointError(
                f"stage {stage}: the zero=3 shards of chunk {c} hold {flat.numel()} values for "
                f"{total} parameters: shards of different checkpoints were mixed"
            )
        module = dict(saved[0]["modules"][c])
        offset = 0
        for name, shape in named:
            n = torch.Size(shape).numel()
            module[name] = flat[offset : offset + n].view(shape).clone()
            offset += n
        modules.append(module)
    return [{**state, "modules": modules} for state in saved]
