"""A stage runtime's checkpoint state, and its re-sharding across data-parallel layouts.

A shard file holds what one (stage, data-parallel rank) needs to resume between program runs:
the chunk modules' state dicts, the optimizer's state dict (under ZeRO only this rank's shard of
it) and its learning-rate scheduler's, the layout it was saved under (`data_parallel`, `zero`,
`rank`, parameter counts), per chunk its parameters' names in `parameters()` order (`names`:
what a load into another shape maps the optimizer state by, `backends.checkpoint.reshape`), its
identity (`stage` and the `segments` it holds, with `rank`: checked on load, so shards swapped
between stages or ranks are refused) and the RNG states. Between runs every pipeline is
drained, so no activation and no stashed weight version is live (a weight-delayed schedule
restarts its versions at every program run, see `backends.local.Engine.train`).

[Note: elastic resume] Where only the data-parallel degree or ZeRO on/off differs, the optimizer
state is first put in a canonical form — per chunk and per state name, one flat tensor over the
chunk's parameters in `parameters()` order, as if unsharded — by concatenating the saved ranks'
shards in rank order; then cut again for the new layout. This is exact for optimizers whose state
is elementwise per parameter (SGD with momentum, Adam, AdamW, ...): each state tensor has its
parameter's (or shard's) shape, and scalars such as Adam's `step` are equal on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from schedcc.backends.checkpoint.sharded import shard_state
from schedcc.errors import CheckpointError

if TYPE_CHECKING:
    from schedcc.backends.runtime.zero import Reducer

__all__ = [
    "canonical_optimizer_state",
    "layout_optimizer_state",
    "rng_state",
    "set_rng_state",
    "stage_state",
]


def stage_state(
    modules: Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None,
    reducer: Reducer,
    *,
    stage: int,
    segments: Sequence[int],
    zero: int,
    rank: int,
    size: int,
    skipped_steps: int,
    loss_scale: dict[str, float] | None,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> dict[str, Any]:
    """What a checkpoint keeps of one stage's data-parallel rank `rank` (of `size`) between
    runs, without the RNG states; under ZeRO-3 the parameters as this rank's shards
    (`backends.checkpoint.sharded`)."""
    state = {
        "modules": [mod.state_dict() for mod in modules],
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "zero": zero,
        "stage": stage,
        "segments": list(segments),
        "rank": rank,
        "data_parallel": size,
        "numels": [[p.numel() for p in mod.parameters()] for mod in modules],
        "names": [[name for name, _ in mod.named_parameters()] for mod in modules],
        "skipped_steps": skipped_steps,
        "loss_scale": loss_scale,
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
    }
    if zero == 3:  # the parameters are only this rank's shards
        state.update(shard_state(modules, reducer))
    return state


def rng_state() -> dict[str, Any]:
    """The RNG states of this process (CPU, and CUDA when present)."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def canonical_optimizer_state(
    saved: Sequence[dict[str, Any]], numels: Sequence[Sequence[int]]
) -> list[dict[str, Any]]:
    """Per chunk, `{state name: flat tensor over the chunk's parameters, or a scalar}`.

    Args:
        saved: every data-parallel rank's shard state of one stage, in rank order.
        numels: `numels[c]` lists the parameter sizes of chunk c, in `parameters()` order.
    """
    first = saved[0]
    if first["optimizer"] is None:
        return [{} for _ in numels]
    chunks: list[dict[str, Any]] = []
    for c, sizes in enumerate(numels):
        total = sum(sizes)
        if first["zero"]:
            per_rank = [s["optimizer"]["state"].get(c, {}) for s in saved]
            chunks.append(_join(per_rank, total))
        else:
            start = sum(len(n) for n in numels[:c])
            states = [first["optimizer"]["state"].get(start + j, {}) for j in range(len(sizes))]
            chunks.append(_join(states, total))
    return chunks


def _join(parts: Sequence[dict[str, Any]], total: int) -> dict[str, Any]:
    """Concatenate per-part state tensors (flattened) into one, trimmed to `total` elements."""
    joined: dict[str, Any] = {}
    names = {name for part in parts for name in part}
    for name in sorted(names):
        values = [part.get(name) for part in parts]
        if any(v is None for v in values):
            raise CheckpointError(
                f"optimizer state {name!r} is present for some parameters only; it cannot be "
                "re-sharded"
            )
        if all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values):
            flat = torch.cat([v.reshape(-1) for v in values])
            if flat.numel() < total:
                raise CheckpointError(
                    f"optimizer state {name!r} holds {flat.numel()} values for {total} "
                    "parameter values: it was saved from another model"
                )
            joined[name] = flat[:total]
        elif all(_same_scalar(v, values[0]) for v in values):
            joined[name] = values[0]  # a scalar (e.g. Adam's step), equal across parts
        else:
            raise CheckpointError(
                f"optimizer state {name!r} is {values[0]!r} for one part and "
                f"{next(v for v in values if not _same_scalar(v, values[0]))!r} for another: "
                "it cannot be re-sharded (shards of different checkpoints were mixed)"
            )
    return joined


def _same_scalar(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def layout_optimizer_state(
    canonical: Sequence[dict[str, Any]],
    numels: Sequence[Sequence[int]],
    shapes: Sequence[Sequence[torch.Size]],
    *,
    zero: int,
    rank: int,
    size: int,
) -> dict[int, dict[str, Any]]:
    """The optimizer `state` mapping for the new layout (ZeRO shard or per-parameter)."""
    state: dict[int, dict[str, Any]] = {}
    index = 0
    for c, chunk in enumerate(canonical):
        total = sum(numels[c])
        if zero:
            shard = max(1, math.ceil(total / size))
            state[c] = {
                name: _pad(value, shard * size)[rank * shard : (rank + 1) * shard].clone()
                if _is_flat(value)
                else _copy(value)
                for name, value in chunk.items()
            }
            continue
        offset = 0
        for n, shape in zip(numels[c], shapes[c]):
            state[index] = {name: _cut(value, offset, n, shape) for name, value in chunk.items()}
            offset += n
            index += 1
    return {k: v for k, v in state.items() if v}


def _cut(value: Any, offset: int, n: int, shape: torch.Size) -> Any:
    if not _is_flat(value):
        return _copy(value)
    return value[offset : offset + n].reshape(shape).clone()


def _copy(value: Any) -> Any:
    # Each parameter needs its own scalar state: optimizers update e.g. Adam's `step` in place.
    return value.clone() if isinstance(value, torch.Tensor) else value


def _is_flat(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1


def _pad(flat: torch.Tensor, length: int) -> torch.Tensor:
    if flat.numel() >= length:
        return flat[:length]
    return torch.cat([flat, flat.new_zeros(length - flat.numel())])
