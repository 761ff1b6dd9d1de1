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

import math
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
    """`saved` (every old rank's state of one stage, in rank order, each passed
    `schema.check_shard`) with whole parameters in `modules`; unchanged unless it was saved
    under ZeRO-3.

    Raises:
        CheckpointError: the ZeRO-3 fields do not describe one chunk's parameters: other
            chunk counts, names not in the chunk's state, sizes other than the shapes', or
            shards of other sizes or dtypes than one save of `len(saved)` ranks writes (the
            same dtype on every rank).
    """
    if not saved or saved[0]["zero"] != 3:
        return list(saved)
    for rank, state in enumerate(saved):
        _check_fields(shard_name(state["stage"], rank), state, len(saved))
    parameters = []
    for c, named in enumerate(saved[0]["shapes"]):
        dtypes = [state["shards"][c].dtype for state in saved]
        if len(set(dtypes)) != 1:
            stage, rank = saved[0]["stage"], next(r for r, d in enumerate(dtypes) if d != dtypes[0])
            raise CheckpointError(
                f"{shard_name(stage, rank)}: shards[{c}] is {dtypes[rank]}, "
                f"{shard_name(stage, 0)}'s {dtypes[0]}: shards of different checkpoints were mixed"
            )
        flat = torch.cat([state["shards"][c] for state in saved])
        whole, offset = {}, 0
        for name, shape in named:
            n = torch.Size(shape).numel()
            whole[name] = flat[offset : offset + n].view(shape).clone()
            offset += n
        parameters.append(whole)
    return [
        {**state, "modules": [{**mod, **whole} for mod, whole in zip(state["modules"], parameters)]}
        for state in saved
    ]


def _check_fields(name: str, state: dict[str, Any], size: int) -> None:
    """One ZeRO-3 shard's `shards`, `shapes` and `numels` agree with each other and with its
    chunks' module states, and each flat shard has the size and dtype a save of `size` ranks
    gives it (`Reducer`'s: the chunk's values over `size`, rounded up, at least 1)."""
    chunks = len(state["modules"])
    counts = {key: len(state[key]) for key in ("shards", "shapes", "numels")}
    if set(counts.values()) != {chunks}:
        raise CheckpointError(
            f"{name}: the zero=3 fields hold {counts} chunks, its modules {chunks}: it was altered"
        )
    for c, (shard, named, sizes, module) in enumerate(
        zip(state["shards"], state["shapes"], state["numels"], state["modules"])
    ):
        names = [entry[0] for entry in named]
        if len(set(names)) != len(names) or not set(names) <= module.keys():
            raise CheckpointError(
                f"{name}: shapes[{c}] names {names}, not distinct keys of modules[{c}] "
                f"{sorted(module)}: it was altered"
            )
        numels = [torch.Size(shape).numel() for _, shape in named]
        if numels != sizes:
            raise CheckpointError(
                f"{name}: shapes[{c}] gives sizes {numels}, numels[{c}] {sizes}: it was altered"
            )
        expected = max(1, math.ceil(sum(sizes) / size))
        dtypes = {module[n].dtype for n in names if isinstance(module[n], torch.Tensor)}
        if shard.numel() != expected or dtypes - {shard.dtype}:
            raise CheckpointError(
                f"{name}: shards[{c}] is {tuple(shard.shape)} {shard.dtype}, not the "
                f"({expected},) {'/'.join(map(str, dtypes)) or 'tensor'} of {sum(sizes)} "
                f"values over {size} ranks: it was altered, or shards of different "
                "checkpoints were mixed"
            )
