"""Restoring a `StageRuntime` from a checkpoint: does every saved shard fit, and its optimizer.

A checkpoint keeps, per data-parallel rank of a stage, what `StageRuntime.state_dict` returns and
the RNG states. `check_saved` is the first phase of [Note: refuse before changing anything] (in
`backends.checkpoint.files`): it checks everything loading relies on, so that loading cannot fail
half-way —

- the shard's identity: the stage, data-parallel rank and segment indices it records are the ones
  it is loaded as (a shard swapped or renamed between stages or ranks is refused);
- every chunk's tensors: the same names, shapes and dtypes as this model's;
- the RNG states: the CPU state is one `torch.set_rng_state` accepts (tried, then put back);
- the optimizer state as it will be loaded (re-laid out first where the data-parallel degree or
  ZeRO differ, see `backends.checkpoint.state`): the same kind of optimizer (its hyperparameter
  names), the same parameter groups, every state tensor of its parameter's shape.

`load_stage` then loads what was checked: the modules' states (and the shards, tied copies and
loss scale made from them) and the optimizer state (`load_optimizer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from schedcc.backends.checkpoint.files import shard_name
from schedcc.backends.checkpoint.state import canonical_optimizer_state, layout_optimizer_state
from schedcc.errors import CheckpointError

if TYPE_CHECKING:
    from schedcc.backends.runtime.clipping import LossScaler
    from schedcc.backends.runtime.stage import StageRuntime
    from schedcc.backends.runtime.tied import StageTies
    from schedcc.backends.runtime.zero import Reducer

__all__ = ["check_saved", "load_optimizer", "load_stage", "optimizer_state"]

#: What every shard records, and of which type (`bool` is never taken for `int`).
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "stage": int,
    "rank": int,
    "data_parallel": int,
    "segments": list,
    "zero": int,
    "numels": list,
    "modules": list,
    "optimizer": (dict, type(None)),
    "rng": dict,
}


def check_saved(runtime: StageRuntime, saved: Sequence[dict[str, Any]]) -> None:
    """Raise `CheckpointError` unless `saved` (every old data-parallel rank's shard of this
    stage, in rank order) fits `runtime` whole; nothing is changed either way."""
    stage, modules = runtime.stage, runtime.modules
    schedule = runtime.program.schedule
    segments = [schedule.segment_of(stage, c) for c in range(len(modules))]
    for rank, state in enumerate(saved):
        name = shard_name(stage, rank)
        _check_identity(name, state, stage, rank, len(saved), segments)
        _check_modules(name, state, modules, segments)
        _check_rng(name, state["rng"])
    if len({state["zero"] for state in saved}) != 1:
        raise CheckpointError(
            f"stage {stage}: the checkpoint's data-parallel shards disagree on ZeRO "
            f"({[state['zero'] for state in saved]}): shards of different checkpoints were mixed"
        )
    coll = runtime.collectives
    optimizer_state(
        runtime.optimizer,
        saved,
        modules,
        zero=runtime.program.zero,
        rank=coll.rank,
        size=coll.size,
    )


def load_stage(
    saved: Sequence[dict[str, Any]],
    modules: Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None,
    reducer: Reducer,
    *,
    ties: StageTies | None,
    scaler: LossScaler | None,
    zero: int,
    rank: int,
    size: int,
) -> None:
    """Load `saved` (every old data-parallel rank's whole state of one stage, in rank order,
    checked by `check_saved`) into a stage's modules, ZeRO shards (`reducer`), tied copies,
    loss scale and optimizer, re-sharded to (zero, rank, size)."""
    with reducer.placeholders():  # ZeRO-3: loaded whole, kept as this rank's shard
        for mod, state in zip(modules, saved[0]["modules"]):
            mod.load_state_dict(state)
        if ties is not None:
            ties.refresh()
        reducer.refresh_shards()
        if scaler is not None and saved[0].get("loss_scale"):
            scaler.load_state_dict(saved[0]["loss_scale"])
        if optimizer is not None:
            load_optimizer(optimizer, saved, modules, zero=zero, rank=rank, size=size)


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
    optimizer.load_state_dict(
        optimizer_state(optimizer, saved, modules, zero=zero, rank=rank, size=size)
    )


def optimizer_state(
    optimizer: torch.optim.Optimizer | None,
    saved: Sequence[dict[str, Any]],
    modules: Sequence[nn.Module],
    *,
    zero: bool,
    rank: int,
    size: int,
) -> dict[str, Any] | None:
    """The state dict `optimizer` gets from `saved`, laid out for (zero, rank, size) and
    checked against `optimizer`; None for a stage without parameters (no optimizer).

    Raises:
        CheckpointError: the saved state is not this kind of optimizer's, has other parameter
            groups, or a state tensor of another shape than its parameter.
    """
    if optimizer is None:
        return None
    stage = saved[0].get("stage")
    for rank_saved, state in enumerate(saved):
        _check_saved_groups(shard_name(stage, rank_saved), state["optimizer"], optimizer)
    try:
        target = _laid_out(optimizer, saved, modules, zero=zero, rank=rank, size=size)
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise CheckpointError(
            f"stage {stage}: the checkpoint's optimizer state cannot be laid out for "
            f"data_parallel={size}, zero={int(zero)}: {type(exc).__name__}: {exc}"
        ) from None
    _check_state(f"stage {stage}", target, optimizer)
    return target


# -- the checks ----------------------------------------------------------------------------------


def _check_identity(
    name: str, state: dict[str, Any], stage: int, rank: int, size: int, segments: list[int]
) -> None:
    for key, kind in _FIELDS.items():
        value = state.get(key)
        if not isinstance(value, kind) or type(value) is bool:
            raise CheckpointError(
                f"{name} records no {key!r} (got {type(value).__name__}): it is not a shard "
                "this version of schedcc wrote, or it was altered"
            )
    if state["stage"] != stage or state["segments"] != segments:
        raise CheckpointError(
            f"{name} holds stage {state['stage']} (segments {state['segments']}) but is loaded "
            f"as stage {stage} (segments {segments}): shards were swapped or renamed"
        )
    if state["rank"] != rank or state["data_parallel"] != size:
        raise CheckpointError(
            f"{name} holds data-parallel rank {state['rank']} of {state['data_parallel']} but is "
            f"loaded as rank {rank} of {size}: shards were swapped or renamed"
        )


def _check_modules(
    name: str, state: dict[str, Any], modules: Sequence[nn.Module], segments: list[int]
) -> None:
    numels = [[p.numel() for p in mod.parameters()] for mod in modules]
    if state["numels"] != numels or len(state["modules"]) != len(modules):
        raise CheckpointError(
            f"{name}: the checkpoint's parameters have sizes {state['numels']}, this model's "
            f"{numels}: it was saved from another model"
        )
    for segment, module, tensors in zip(segments, modules, state["modules"]):
        where = f"{name}: segment {segment}"
        current = module.state_dict()
        if not isinstance(tensors, dict) or tensors.keys() != current.keys():
            names = sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__
            raise CheckpointError(
                f"{where} holds {names}, this model's {sorted(current)}: it was saved from "
                "another model"
            )
        for key, tensor in current.items():
            value = tensors[key]
            if isinstance(tensor, torch.Tensor) and not _same_kind(value, tensor):
                raise CheckpointError(
                    f"{where}: {key} is {_describe(value)}, this model's {_describe(tensor)}: "
                    "it was saved from another model"
                )


def _check_rng(name: str, rng: dict[str, Any]) -> None:
    cpu = rng.get("cpu")
    current = torch.get_rng_state()
    try:
        torch.set_rng_state(cpu)  # the one full check of a generator's state: try it
    except (RuntimeError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{name}: its CPU RNG state cannot be restored ({_first_line(exc)})"
        ) from None
    finally:
        torch.set_rng_state(current)
    cuda = rng.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return  # only restored where CUDA is there (see `state.set_rng_state`)
    if not isinstance(cuda, (list, tuple)) or len(cuda) > torch.cuda.device_count():
        raise CheckpointError(
            f"{name}: its CUDA RNG states are not one byte tensor per visible GPU"
        )
    if not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda):
        raise CheckpointError(f"{name}: its CUDA RNG states are not byte tensors")


def _check_saved_groups(name: str, saved: Any, optimizer: torch.optim.Optimizer) -> None:
    """The saved optimizer has the state dict's form and this optimizer's parameter groups."""
    if not (
        isinstance(saved, dict)
        and isinstance(saved.get("state"), dict)
        and isinstance(saved.get("param_groups"), list)
        and all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved["param_groups"]
        )
    ):
        raise CheckpointError(f"{name} holds no optimizer state dict (state, param_groups)")
    groups = [set(g) - {"params"} for g in optimizer.param_groups]
    old = [set(g) - {"params"} for g in saved["param_groups"]]
    if old != groups:
        raise CheckpointError(
            f"{name}: the optimizer was another kind, or grouped otherwise: parameter groups "
            f"with {[sorted(g) for g in old]}, this optimizer's {[sorted(g) for g in groups]}"
        )


def _check_state(where: str, target: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """`target` loads into `optimizer` whole: each state tensor of its parameter's shape."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    lengths = [len(g["params"]) for g in target["param_groups"]]
    if lengths != [len(g["params"]) for g in optimizer.param_groups]:
        raise CheckpointError(
            f"{where}: the checkpoint's optimizer groups hold {lengths} parameters, this "
            f"optimizer's {[len(g['params']) for g in optimizer.param_groups]}"
        )
    ids = [i for g in target["param_groups"] for i in g["params"]]
    index = {i: position for position, i in enumerate(ids)}
    if len(index) != len(ids):
        raise CheckpointError(f"{where}: the checkpoint's optimizer names a parameter twice")
    names = set()
    for key, entry in target["state"].items():
        if key not in index or not isinstance(entry, dict):
            raise CheckpointError(
                f"{where}: the checkpoint's optimizer holds state for {key!r}, which is none of "
                "its parameters"
            )
        shape = params[index[key]].shape
        for name, value in entry.items():
            names.add(name)
            if isinstance(value, torch.Tensor):
                if value.dim() > 0 and value.shape != shape:
                    raise CheckpointError(
                        f"{where}: optimizer state {name!r} of parameter {index[key]} has shape "
                        f"{tuple(value.shape)}, the parameter {tuple(shape)}"
                    )
            elif value is not None and not isinstance(value, (int, float)):
                raise CheckpointError(
                    f"{where}: optimizer state {name!r} of parameter {index[key]} is a "
                    f"{type(value).__name__}"
                )
    now = {name for entry in optimizer.state.values() for name in entry}
    if now and names and now != names:
        raise CheckpointError(
            f"{where}: the checkpoint's optimizer state holds {sorted(names)}, this optimizer's "
            f"{sorted(now)}: the optimizer was another kind"
        )


# -- helpers -------------------------------------------------------------------------------------


def _laid_out(
    optimizer: torch.optim.Optimizer,
    saved: Sequence[dict[str, Any]],
    modules: Sequence[nn.Module],
    *,
    zero: bool,
    rank: int,
    size: int,
) -> dict[str, Any]:
    if saved[0]["zero"] == zero and len(saved) == size:
        return saved[rank]["optimizer"]
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
    return target


def _same_kind(value: Any, tensor: torch.Tensor) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.shape == tensor.shape
        and value.dtype == tensor.dtype
    )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    return f"a {type(value).__name__}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
