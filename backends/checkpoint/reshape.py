"""Loading a checkpoint into another shape, by the parameters' names: each stage's shard.

[Note: re-shaping by name] A checkpoint's shards hold each chunk's module state and, per chunk,
its parameters' names in `parameters()` order (`names`). Every tensor of the model has a
*model-wide name* (`model.model_names`): its key in its segment's state dict where no two segments
share a key (the segments keep the model's own module names, as `schedcc.partition` and
`schedcc.split` do: `"2.weight"` whichever segment holds layer 2), else `segment<k>.<key>`.
Where the program's shape differs from the checkpoint's in anything but the data-parallel
degree and ZeRO (another m, schedule, v, p or cut), a load reads the shards of the stages that
hold its tensors, which the manifest's cut names (`model.read_model`; `files.cut_of`), checks
each as a load of its own shape would (its schema, its identity, its stage's shards agreeing,
the ZeRO-3 shards whole, its RNG states, its optimizer state against this optimizer in the
layout it was saved in) and against the cut (its segments' keys), and takes
each parameter's value and optimizer state by name: a ZeRO shard's state is joined over its
ranks and cut per parameter ([Note: elastic resume] in `backends.checkpoint.state`). For each
stage of the new program it then builds the shard a save of one data-parallel rank without ZeRO
would have written (`stage_shard`), which the ordinary checks and load take from there, and
re-shard to the program's data-parallel degree and ZeRO.

What cannot carry over is refused, before anything changes, with a `CheckpointError` naming the
tensor and the file: a name of this model the checkpoint lacks, a name of the checkpoint this
model lacks (a checkpoint loads whole or not at all), another shape or dtype, the stages'
optimizer settings, skipped steps or loss scales differing among the stages read (they are
one run's, equal on every stage), or an optimizer of several parameter groups (its groups are
positional: they do not map across cuts). The RNG state is per rank: a rank takes the saved
state of the rank of the same *global index* `dp_rank * p + stage` in the checkpoint (modulo
the number of saved ranks), so a run of the same shape restores exactly and one of another
shape is reseeded from a saved state deterministically; the local engine, one process, takes
index 0's as it does for a checkpoint of its own shape.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from schedcc.backends.checkpoint.model import SavedModel
from schedcc.backends.checkpoint.schema import describe
from schedcc.errors import CheckpointError

if TYPE_CHECKING:
    from schedcc.backends.runtime.stage import StageRuntime

__all__ = ["runtime_shard", "stage_shard"]


def stage_shard(
    saved: SavedModel,
    directory: str | os.PathLike,
    *,
    stage: int,
    segments: Sequence[int],
    modules: Sequence[torch.nn.Module],
    kinds: Sequence[Mapping[str, tuple[torch.Size, torch.dtype]]],
    names: Mapping[int, Mapping[str, str]],
    optimizer: torch.optim.Optimizer | None,
) -> dict[str, Any]:
    """The shard one rank of `stage` without ZeRO would have saved, built from `saved` by name.

    Args:
        saved: what `read_model` read.
        directory: the checkpoint (for messages).
        stage: the stage in the new program.
        segments: its segments, by chunk.
        modules: its chunk modules (their keys and parameter names; not changed).
        kinds: per chunk, each state tensor's whole shape and dtype.
        names: the new model's model-wide names (`model_names` of the whole new model).
        optimizer: the stage's optimizer, or None.

    Raises:
        CheckpointError: a tensor of this stage that the checkpoint lacks, or of another shape
            or dtype; or the stage has an optimizer the checkpoint holds no state of, or one of
            several parameter groups.
    """
    where = f"checkpoint {directory}"
    chunks, params = [], []
    for c, (k, module) in enumerate(zip(segments, modules)):
        state = {}
        for key in module.state_dict():
            name = names[k][key]
            if name not in saved.files:
                raise CheckpointError(
                    f"{where}: this model's {name} (segment {k}) is in none of its files: it "
                    "was saved from another model"
                )
            value = saved.tensors[name]
            if key in kinds[c] and not _fits(value, kinds[c][key]):
                shape, dtype = kinds[c][key]
                raise CheckpointError(
                    f"{where}: {name} is {describe(value)} in {saved.files[name]}, this "
                    f"model's {tuple(shape)} {dtype}: it was saved from another model"
                )
            state[key] = value
        chunks.append(state)
        params.append([names[k][key] for key, _ in module.named_parameters()])
    return {
        "stage": stage,
        "rank": 0,
        "data_parallel": 1,
        "segments": list(segments),
        "zero": 0,
        "numels": [[saved.tensors[name].numel() for name in chunk] for chunk in params],
        "names": [[key for key, _ in module.named_parameters()] for module in modules],
        "modules": chunks,
        "optimizer": _optimizer_state(saved, where, optimizer, params),
        "rng": saved.rng,
        "skipped_steps": saved.skipped_steps,
        "loss_scale": saved.loss_scale,
        "lr_scheduler": saved.lr_scheduler,
    }


def _optimizer_state(
    saved: SavedModel,
    where: str,
    optimizer: torch.optim.Optimizer | None,
    params: Sequence[Sequence[str]],
) -> dict[str, Any] | None:
    if optimizer is None:
        return None
    if saved.settings is None:
        raise CheckpointError(f"{where} holds no optimizer state, but this stage has an optimizer")
    if len(optimizer.param_groups) != 1:
        raise CheckpointError(
            f"{where}: this stage's optimizer has {len(optimizer.param_groups)} parameter "
            "groups; a checkpoint loads into another shape by parameter name, and parameter "
            "groups are positional: use one group, or the shape the checkpoint was saved from"
        )
    order = [name for chunk in params for name in chunk]
    state = {
        i: {key: _copy(value) for key, value in saved.optimizer[name].items()}
        for i, name in enumerate(order)
        if saved.optimizer.get(name)
    }
    return {"state": state, "param_groups": [{**saved.settings, "params": list(range(len(order)))}]}


def runtime_shard(
    saved: SavedModel,
    directory: str | os.PathLike,
    runtime: StageRuntime,
    names: Mapping[int, Mapping[str, str]],
) -> dict[str, Any]:
    """`stage_shard` for a stage runtime, checked as any shard it loads (`check_state`), so
    that loading it cannot fail; nothing is changed.

    Raises:
        CheckpointError: as `stage_shard`, or the shard does not fit (naming the stage).
    """
    schedule = runtime.program.schedule
    stage = runtime.stage
    shard = stage_shard(
        saved,
        directory,
        stage=stage,
        segments=[schedule.segment_of(stage, c) for c in range(len(runtime.modules))],
        modules=runtime.modules,
        kinds=runtime.state.tensor_kinds(),
        names=names,
        optimizer=runtime.optimizer,
    )
    try:
        runtime.state.check_state([shard])
    except CheckpointError as exc:
        raise CheckpointError(
            f"checkpoint {directory}, taken by name for stage {stage}: {exc}"
        ) from None
    return shard


def _fits(value: Any, kind: tuple[torch.Size, torch.dtype]) -> bool:
    return isinstance(value, torch.Tensor) and (value.shape, value.dtype) == tuple(kind)


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
