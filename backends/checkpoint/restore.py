"""Restoring a `StageState` from a checkpoint: does every saved shard fit, and its optimizer.

A checkpoint keeps, per data-parallel rank of a stage, what `StageState.state_dict` returns and
the RNG states. `check_saved` is the first phase of [Note: refuse before changing anything] (in
`backends.checkpoint.files`): it checks everything loading relies on, so that loading cannot fail
half-way —

- every field of every shard, its type and range (`backends.checkpoint.schema`), and that a
  stage's shards agree where every rank records the same (layout, skipped steps, loss scale,
  optimizer settings, learning-rate scheduler);
- under ZeRO-3, that the parameter shards make the chunks' parameters whole
  (`backends.checkpoint.sharded`);
- the shard's identity: the stage, data-parallel rank and segment indices it records are the ones
  it is loaded as (a shard swapped or renamed between stages or ranks is refused);
- every chunk's tensors: the same names, shapes and dtypes as this model's, and its parameters'
  names (`names`, what a load into another shape maps by) this model's;
- the learning-rate scheduler's state, where the engine has one: of the same kind of scheduler;
- the RNG states: the CPU state is one `torch.set_rng_state` accepts (tried, then put back);
- each shard's optimizer state in the layout it was saved in, and again as it will be loaded
  (re-laid out first where the data-parallel degree or ZeRO differ, see
  `backends.checkpoint.state`): the same kind of optimizer (its settings'
  names, each setting of the kind of this optimizer's, and accepted by it), the same parameter
  groups, each parameter's state of the names one step of this optimizer gives, every state
  tensor of its parameter's shape and dtype ([Note: the optimizer's own check]).

`load_stage` then loads what was checked: the modules' states (and the shards, tied copies and
loss scale made from them) and the optimizer state (`load_optimizer`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from schedcc.backends.checkpoint.files import shard_name
from schedcc.backends.checkpoint.optimizer import check_settings, check_state
from schedcc.backends.checkpoint.schema import check_shard, check_stage_shards, describe
from schedcc.backends.checkpoint.sharded import whole_states
from schedcc.backends.checkpoint.state import canonical_optimizer_state, layout_optimizer_state
from schedcc.errors import CheckpointError

if TYPE_CHECKING:
    from schedcc.backends.runtime.clipping import LossScaler
    from schedcc.backends.runtime.stage_state import StageState
    from schedcc.backends.runtime.tied import StageTies
    from schedcc.backends.runtime.zero import Reducer

__all__ = [
    "check_rng",
    "check_saved",
    "load_optimizer",
    "load_stage",
    "optimizer_state",
    "saved_layout",
]


def check_saved(runtime: StageState, saved: Sequence[dict[str, Any]]) -> None:
    """Raise `CheckpointError` unless `saved` (every old data-parallel rank's shard of this
    stage, in rank order, as read) fits `runtime` (the stage's `StageState`) whole; nothing is
    changed either way.

    Under ZeRO-3 call it with the stage's placeholders in place (`Reducer.placeholders`):
    the tensors are checked against the whole parameters' shapes."""
    stage, modules = runtime.stage, runtime.modules
    schedule = runtime.program.schedule
    segments = [schedule.segment_of(stage, c) for c in range(len(modules))]
    names = [shard_name(stage, rank) for rank in range(len(saved))]
    for name, state in zip(names, saved):
        check_shard(name, state)
    for rank, (name, state) in enumerate(zip(names, saved)):
        _check_identity(name, state, stage, rank, len(saved), segments)
    check_stage_shards(names, saved)
    whole = whole_states(saved)
    for name, state in zip(names, whole):
        _check_modules(name, state, modules, segments)
        check_rng(name, state["rng"])
    if runtime.optimizer is not None and whole[0]["optimizer"] is None:
        raise CheckpointError(
            f"{names[0]} holds no optimizer state, but this stage has an optimizer: it was altered"
        )
    _check_lr_scheduler(names[0], whole[0]["lr_scheduler"], runtime.lr_scheduler)
    coll = runtime.collectives
    optimizer_state(
        runtime.optimizer,
        whole,
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
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    zero: int,
    rank: int,
    size: int,
) -> None:
    """Load `saved` (every old data-parallel rank's whole state of one stage, in rank order,
    checked by `check_saved`) into a stage's modules, ZeRO shards (`reducer`), tied copies,
    loss scale, optimizer (re-sharded to (zero, rank, size)) and learning-rate scheduler."""
    with reducer.placeholders():  # ZeRO-3: loaded whole, kept as this rank's shard
        for mod, state in zip(modules, saved[0]["modules"]):
            mod.load_state_dict(state)
        if ties is not None:
            ties.refresh()
        reducer.refresh_shards()
        if scaler is not None and saved[0]["loss_scale"] is not None:
            scaler.load_state_dict(saved[0]["loss_scale"])
        if optimizer is not None:
            load_optimizer(optimizer, saved, modules, zero=zero, rank=rank, size=size)
        if lr_scheduler is not None:  # its own copy: a scheduler keeps the lists it loads
            lr_scheduler.load_state_dict(copy.deepcopy(saved[0]["lr_scheduler"]))


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
            groups or settings it refuses, or a state of other names, or a state tensor of
            another shape or dtype than its parameter.
    """
    if optimizer is None:
        return None
    stage = saved[0]["stage"]
    for rank_saved, state in enumerate(saved):
        name = shard_name(stage, rank_saved)
        check_settings(name, state["optimizer"], optimizer)
        check_state(
            name,
            state["optimizer"],
            optimizer,
            like=saved_layout(state, [list(mod.parameters()) for mod in modules]),
        )
    try:
        target = _laid_out(optimizer, saved, modules, zero=zero, rank=rank, size=size)
    except CheckpointError as exc:
        raise CheckpointError(f"stage {stage}: the checkpoint's optimizer state: {exc}") from None
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise CheckpointError(
            f"stage {stage}: the checkpoint's optimizer state cannot be laid out for "
            f"data_parallel={size}, zero={int(zero)}: {type(exc).__name__}: {exc}"
        ) from None
    relaid = saved[0]["zero"] != zero or len(saved) != size
    where = f"stage {stage} (re-sharded)" if relaid else shard_name(stage, rank)
    check_state(where, target, optimizer)
    return target


# -- the checks ----------------------------------------------------------------------------------


def _check_identity(
    name: str, state: dict[str, Any], stage: int, rank: int, size: int, segments: list[int]
) -> None:
    if state["stage"] != stage or state["segments"] != segments:
        raise CheckpointError(
            f"{name} holds stage {state['stage']} (segments {state['segments']}) but is loaded "
            f"as stage {stage} (segments {segments}): shards were swapped or renamed"
        )
    if state["rank"] != rank or state["data_parallel"] != size:
        raise CheckpointError(
            f"{name} holds data-parallel rank {state['rank']} of {state['data_parallel']} but is "
            f"loaded as rank {rank} of {size} (its rank and data_parallel): shards were swapped "
            "or renamed"
        )


def _check_lr_scheduler(
    name: str, saved: dict[str, Any] | None, scheduler: torch.optim.lr_scheduler.LRScheduler | None
) -> None:
    """A stage given an `lr_scheduler` needs the saved state of the same kind of scheduler over
    as many parameter groups (a stage without one resumes at the learning rate the optimizer
    state holds, and ignores a saved scheduler)."""
    if scheduler is None:
        return
    kind = type(scheduler).__name__
    if saved is None:
        raise CheckpointError(
            f"{name} holds no lr_scheduler state, but this engine steps a {kind}: resume "
            "without lr_scheduler=, or from a checkpoint saved with one"
        )
    current = scheduler.state_dict()
    if saved.keys() != current.keys() or len(saved["base_lrs"]) != len(current["base_lrs"]):
        raise CheckpointError(
            f"{name}: lr_scheduler holds {sorted(saved)} for {len(saved['base_lrs'])} parameter "
            f"group(s), this engine's {kind} {sorted(current)} for {len(current['base_lrs'])}: "
            "it was saved with another kind of scheduler"
        )


def _check_modules(
    name: str, state: dict[str, Any], modules: Sequence[nn.Module], segments: list[int]
) -> None:
    numels = [[p.numel() for p in mod.parameters()] for mod in modules]
    if state["numels"] != numels or len(state["modules"]) != len(modules):
        raise CheckpointError(
            f"{name}: numels is {state['numels']}, this model's parameters' sizes {numels} "
            f"(in {len(state['modules'])} modules, this model's {len(modules)}): it was saved "
            "from another model"
        )
    names = [[key for key, _ in mod.named_parameters()] for mod in modules]
    if state["names"] != names:
        raise CheckpointError(
            f"{name}: names is {state['names']}, this model's parameters' names {names}: it "
            "was altered, or saved from another model"
        )
    for c, (segment, module, tensors) in enumerate(zip(segments, modules, state["modules"])):
        where = f"{name}: modules[{c}] (segment {segment})"
        current = module.state_dict()
        if tensors.keys() != current.keys():
            raise CheckpointError(
                f"{where} holds {sorted(tensors)}, this model's {sorted(current)}: it was saved "
                "from another model"
            )
        for key, tensor in current.items():
            value = tensors[key]
            if isinstance(tensor, torch.Tensor) and not _same_kind(value, tensor):
                raise CheckpointError(
                    f"{where}: {key} is {describe(value)}, this model's {describe(tensor)}: "
                    "it was saved from another model"
                )


def check_rng(name: str, rng: dict[str, Any]) -> None:
    """Raise `CheckpointError` unless the shard `name`'s RNG states can be restored here
    (each tried, then put back)."""
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
    if len(cuda) > torch.cuda.device_count():
        raise CheckpointError(
            f"{name}: it holds {len(cuda)} CUDA RNG states, for {torch.cuda.device_count()} "
            "visible GPUs"
        )
    for device, state in enumerate(cuda):
        current = torch.cuda.get_rng_state(device)
        try:
            torch.cuda.set_rng_state(state, device)  # tried, as the CPU's
        except (RuntimeError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{name}: its CUDA RNG state of GPU {device} cannot be restored "
                f"({_first_line(exc)})"
            ) from None
        finally:
            torch.cuda.set_rng_state(current, device)


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


def saved_layout(
    state: dict[str, Any], chunks: Sequence[Sequence[torch.Tensor]]
) -> list[torch.Tensor]:
    """Per parameter of the optimizer a shard was saved from, a `meta` tensor of its shape and
    dtype: under ZeRO each chunk's flat shard (the chunk's values over the ranks, rounded up),
    else the chunks' parameters (`chunks[c]`, chunk c's whole parameters in `parameters()`
    order: checked against `state["numels"]`)."""
    if not state["zero"]:
        return [p.to("meta") for params in chunks for p in params]
    layout = []
    for params, sizes in zip(chunks, state["numels"]):
        dtypes = {p.dtype for p in params} or {torch.get_default_dtype()}
        shard = max(1, math.ceil(sum(sizes) / state["data_parallel"]))
        layout.append(torch.empty(shard, dtype=dtypes.pop(), device="meta"))
    return layout


def _same_kind(value: Any, tensor: torch.Tensor) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.shape == tensor.shape
        and value.dtype == tensor.dtype
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
