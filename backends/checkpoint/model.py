"""A checkpoint read as one model, by model-wide name: `read_model` (what loading into another
shape reads, [Note: re-shaping by name] in `backends.checkpoint.reshape`) and `export` (the
whole model's state dict, `schedcc.export`); `model_names`, the model-wide names.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from schedcc.backends.checkpoint.files import (
    MANIFEST,
    checkpoint_directory,
    read_checkpoint,
    read_shard,
    shard_name,
)
from schedcc.backends.checkpoint.optimizer import check_numbering, check_settings, check_state
from schedcc.backends.checkpoint.restore import check_rng, saved_layout
from schedcc.backends.checkpoint.schema import check_shard, check_stage_shards, describe, same_value
from schedcc.backends.checkpoint.sharded import whole_states
from schedcc.backends.checkpoint.state import canonical_optimizer_state, layout_optimizer_state
from schedcc.errors import CheckpointError

__all__ = ["SavedModel", "export", "model_names", "read_model", "rng_index"]


def model_names(keys: Mapping[int, Sequence[str]]) -> dict[int, dict[str, str]]:
    """Per segment `k`, each key of its state dict (`keys[k]`) to its model-wide name: the key
    itself where no two segments share a key, else `segment<k>.<key>` ([Note: re-shaping by
    name]).

    >>> model_names({0: ["0.weight"], 1: ["1.weight"]})
    {0: {'0.weight': '0.weight'}, 1: {'1.weight': '1.weight'}}
    >>> model_names({0: ["weight"], 1: ["weight"]})
    {0: {'weight': 'segment0.weight'}, 1: {'weight': 'segment1.weight'}}
    """
    every = [key for segment in keys.values() for key in segment]
    own = len(set(every)) == len(every)
    return {
        k: {key: key if own else f"segment{k}.{key}" for key in segment}
        for k, segment in sorted(keys.items())
    }


def rng_index(stage: int, dp_rank: int, num_stages: int) -> int:
    """A rank's global index, which picks its saved RNG state ([Note: re-shaping by name])."""
    return dp_rank * num_stages + stage


@attrs.define(frozen=True)
class SavedModel:
    """What a checkpoint holds of the model, by model-wide name (`read_model`).

    Attributes:
        files: every name the checkpoint holds, and the shard that holds it.
        tensors: the module state tensors (parameters and buffers) of the stages read, whole,
            in model order.
        optimizer: each of their parameters' optimizer state (`{}` where it has none yet).
        settings: the optimizer's settings (one parameter group's, without `params`), or None
            where the stages read hold no optimizer state.
        rng: the saved RNG state of the global index asked for (`rng_index`).
        skipped_steps: the run's skipped steps.
        loss_scale: the run's loss scale, or None.
        lr_scheduler: the learning-rate scheduler's state (every stage's alike), or None.
    """

    files: dict[str, str]
    tensors: dict[str, Any]
    optimizer: dict[str, dict[str, Any]]
    settings: dict[str, Any] | None
    rng: dict[str, Any]
    skipped_steps: int
    loss_scale: dict[str, Any] | None
    lr_scheduler: dict[str, Any] | None = None


def read_model(
    directory: str | os.PathLike,
    manifest: dict[str, Any],
    *,
    model: Mapping[int, Mapping[str, str]] | None = None,
    segments: Collection[int] | None = None,
    rng: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
) -> SavedModel:
    """Read and check the shards of a complete, verified checkpoint (`files.verify_files`) and
    key what they hold by model-wide name; nothing is applied.

    Args:
        directory: the checkpoint.
        manifest: its manifest, as `files.read_checkpoint` returned it.
        model: the loading model's model-wide names (`model_names`), which must be the
            checkpoint's; None: read the whole checkpoint (`export`).
        segments: the segments of `model` that are to be loaded here: only the shards that
            hold them are read (the manifest's `cut` says which, `files.cut_of`, checked
            against each shard read); None: all.
        rng: the global index whose saved RNG state is wanted (`rng_index`).
        optimizer: one of the loading program's; each shard's optimizer state is checked
            against it in the layout it was saved in, as a load of its own shape checks it.

    Raises:
        CheckpointError: a shard fails its checks (as a load of its own shape would refuse it)
            or disagrees with the manifest's cut, the stages read disagree on what one run
            records alike, or the checkpoint holds a name `model` lacks or lacks one it holds.
    """
    meta = manifest["meta"]
    num_stages, dp = (meta.get(key) for key in ("num_stages", "data_parallel"))
    for key, value in (("num_stages", num_stages), ("data_parallel", dp)):
        if type(value) is not int or value < 1:
            raise CheckpointError(
                f"checkpoint {directory}: meta {key} is {value!r}, not an integer >= 1"
            )
    cut = _saved_cut(directory, meta.get("cut"), num_stages)
    rng_rank, rng_stage = divmod(rng % (num_stages * dp), num_stages)
    read: Collection[int] = range(num_stages)
    if cut is not None and model is not None:
        _check_same_names(directory, _files(cut), model)
        read = _holding(cut, model, segments) | {rng_stage}
    stages = {s: _read_stage(directory, manifest, s, dp) for s in sorted(read)}
    placed = _placed(stages, cut)
    if cut is None:
        cut = {k: (s, list(stages[s][0]["modules"][c])) for k, (s, c) in placed.items()}
        if model is not None:
            _check_same_names(directory, _files(cut), model)
    for whole in stages.values():
        _check_optimizer(whole, optimizer)
    tensors, states = _by_name(stages, placed, _names(cut))
    _check_alike(stages)
    first = stages[min(stages)][0]
    return SavedModel(
        files=_files(cut),
        tensors=tensors,
        optimizer=states,
        settings=_settings(stages),
        rng=stages[rng_stage][rng_rank]["rng"],
        skipped_steps=first["skipped_steps"],
        loss_scale=first["loss_scale"],
        lr_scheduler=first.get("lr_scheduler"),
    )


#: Per segment, the stage that holds it and its state dict's keys (the manifest's `cut`).
_Cut = dict[int, tuple[int, list[str]]]


def _names(cut: _Cut) -> dict[int, dict[str, str]]:
    return model_names({k: keys for k, (_, keys) in cut.items()})


def _files(cut: _Cut) -> dict[str, str]:
    """Each model-wide name of the checkpoint, and the shard (data-parallel rank 0's) holding it."""
    names = _names(cut)
    return {names[k][key]: shard_name(s, 0) for k, (s, keys) in sorted(cut.items()) for key in keys}


def _holding(
    cut: _Cut, model: Mapping[int, Mapping[str, str]], segments: Collection[int] | None
) -> set[int]:
    """The old stages whose shards hold a tensor of `segments` of the loading `model`."""
    names = _names(cut)
    held = model if segments is None else {k: model[k] for k in segments}
    wanted = {name for segment in held.values() for name in segment.values()}
    return {cut[k][0] for k in cut if any(names[k][key] in wanted for key in cut[k][1])}


def _placed(
    stages: Mapping[int, Sequence[dict[str, Any]]], cut: _Cut | None
) -> dict[int, tuple[int, int]]:
    """`{segment: (stage, chunk)}` of the shards read, each segment once and, where the
    manifest records a cut, where it places it and of the keys it gives."""
    placed: dict[int, tuple[int, int]] = {}
    for s, whole in stages.items():
        for c, k in enumerate(whole[0]["segments"]):
            keys = list(whole[0]["modules"][c])
            if k in placed or (cut is not None and cut.get(k) != (s, keys)):
                raise CheckpointError(
                    f"{shard_name(s, 0)}: segments[{c}] is segment {k} of keys {keys}, which "
                    "the manifest's cut places otherwise: it was altered"
                )
            placed[k] = (s, c)
    return placed


def _by_name(
    stages: Mapping[int, Sequence[dict[str, Any]]],
    placed: Mapping[int, tuple[int, int]],
    names: Mapping[int, Mapping[str, str]],
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The tensors of the shards read and their parameters' optimizer states, by name."""
    per_parameter = {s: _parameter_states(whole) for s, whole in stages.items()}
    tensors, states = {}, {}
    for k in sorted(placed):
        s, c = placed[k]
        first = stages[s][0]
        for key, value in first["modules"][c].items():
            tensors[names[k][key]] = value
        for key, state in zip(first["names"][c], per_parameter[s][c]):
            states[names[k][key]] = state
    return tensors, states


def _saved_cut(directory: str | os.PathLike, cut: Any, num_stages: int) -> _Cut | None:
    """The manifest's cut as `{segment: (stage, keys)}`; None where it records none."""
    if cut is None:
        return None
    fits = isinstance(cut, list) and all(
        isinstance(entry, dict)
        and entry.keys() == {"stage", "keys"}
        and type(entry["stage"]) is int
        and 0 <= entry["stage"] < num_stages
        and isinstance(entry["keys"], list)
        and all(isinstance(key, str) for key in entry["keys"])
        for entry in cut
    )
    if not fits:
        raise CheckpointError(
            f"{Path(directory) / MANIFEST}: meta cut is not a list of each segment's stage "
            f"(below num_stages {num_stages}) and keys: it was altered"
        )
    return {k: (entry["stage"], entry["keys"]) for k, entry in enumerate(cut)}


def _read_stage(
    directory: str | os.PathLike, manifest: dict[str, Any], stage: int, dp: int
) -> list[dict[str, Any]]:
    """One old stage's shards, checked as a load of their own shape checks them (but for the
    optimizer state: `_check_optimizer`), whole."""
    names = [shard_name(stage, r) for r in range(dp)]
    states = [read_shard(directory, name, manifest) for name in names]
    for name, state in zip(names, states):
        check_shard(name, state)
    for rank, (name, state) in enumerate(zip(names, states)):
        if (state["stage"], state["rank"], state["data_parallel"]) != (stage, rank, dp):
            raise CheckpointError(
                f"{name} holds stage {state['stage']}, data-parallel rank {state['rank']} of "
                f"{state['data_parallel']}, but is the file of stage {stage}, rank {rank} of "
                f"{dp}: shards were swapped or renamed"
            )
    check_stage_shards(names, states)
    whole = whole_states(states)
    for name, state in zip(names, whole):
        _check_names(name, state)
        _check_like_first(name, state, names[0], whole[0])
        check_rng(name, state["rng"])
    return whole


def _check_optimizer(
    whole: Sequence[dict[str, Any]], optimizer: torch.optim.Optimizer | None
) -> None:
    """Each shard's optimizer state against `optimizer` (one of the loading program's) in the
    layout it was saved in; without one, only its numbering (re-sharding reads it)."""
    for rank, state in enumerate(whole):
        name, saved = shard_name(state["stage"], rank), state["optimizer"]
        if saved is not None and optimizer is not None:
            check_settings(name, saved, optimizer)
            params = [
                [mod[key] for key in keys] for keys, mod in zip(state["names"], state["modules"])
            ]
            check_state(name, saved, optimizer, like=saved_layout(state, params))
        elif saved is not None:
            check_numbering(name, saved)


def _check_same_names(
    directory: str | os.PathLike, files: Mapping[str, str], model: Mapping[int, Mapping[str, str]]
) -> None:
    """Refuse a checkpoint that lacks a name of `model` or holds one `model` lacks: a
    checkpoint loads whole or not at all."""
    for k, segment in sorted(model.items()):
        for name in segment.values():
            if name not in files:
                raise CheckpointError(
                    f"checkpoint {directory}: this model's {name} (segment {k}) is in none of "
                    "its files: it was saved from another model"
                )
    ours = {name for segment in model.values() for name in segment.values()}
    extra = [name for name in files if name not in ours]
    if extra:
        raise CheckpointError(
            f"checkpoint {directory}: {extra[0]} (in {files[extra[0]]}) is no tensor of "
            f"this model{f' (nor {len(extra) - 1} more)' if len(extra) > 1 else ''}: it was "
            "saved from another model (a checkpoint loads whole or not at all)"
        )


def _check_like_first(name: str, state: dict[str, Any], first: str, other: dict[str, Any]) -> None:
    """A stage's shards hold module tensors of the same names, shapes and dtypes (the first
    one's are loaded)."""
    for c, (mine, theirs) in enumerate(zip(state["modules"], other["modules"])):
        for key in mine.keys() | theirs.keys():
            a, b = mine.get(key), theirs.get(key)
            if describe(a) != describe(b):
                raise CheckpointError(
                    f"{name}: modules[{c}][{key!r}] is {describe(a)}, {first}'s "
                    f"{describe(b)}: shards of different checkpoints were mixed"
                )


def _check_names(name: str, state: dict[str, Any]) -> None:
    """`names` lists, per chunk, distinct keys of its module state of the sizes `numels` gives."""
    chunks = len(state["modules"])
    if len(state["names"]) != chunks or len(state["numels"]) != chunks:
        raise CheckpointError(
            f"{name}: names holds {len(state['names'])} chunks, numels "
            f"{len(state['numels'])}, modules {chunks}: it was altered"
        )
    for c, (keys, sizes, module) in enumerate(
        zip(state["names"], state["numels"], state["modules"])
    ):
        tensors = [module.get(key) for key in keys]
        numels = [t.numel() if isinstance(t, torch.Tensor) else None for t in tensors]
        if len(set(keys)) != len(keys) or numels != sizes:
            raise CheckpointError(
                f"{name}: names[{c}] is {keys}, not distinct tensors of modules[{c}] of the "
                f"sizes numels[{c}] {sizes}: it was altered"
            )


def _parameter_states(whole: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Per chunk, each parameter's optimizer state, as if saved by one rank without ZeRO."""
    first = whole[0]
    name = shard_name(first["stage"], 0)
    if first["optimizer"] is None:
        return [[{} for _ in sizes] for sizes in first["numels"]]
    shapes = [
        [module[key].shape for key in keys]
        for keys, module in zip(first["names"], first["modules"])
    ]
    try:
        canonical = canonical_optimizer_state(whole, first["numels"])
        flat = layout_optimizer_state(canonical, first["numels"], shapes, zero=0, rank=0, size=1)
    except CheckpointError as exc:
        raise CheckpointError(f"{name}: {exc}") from None
    except (IndexError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"{name}: its optimizer state cannot be cut per parameter: {type(exc).__name__}: {exc}"
        ) from None
    states, index = [], 0
    for sizes in first["numels"]:
        states.append([flat.get(index + j, {}) for j in range(len(sizes))])
        index += len(sizes)
    return states


def _check_alike(stages: Mapping[int, Sequence[dict]]) -> None:
    """The stages read (by stage) record one run alike: its skipped steps, its loss scale and
    its learning-rate scheduler's state."""
    lowest = min(stages)
    first = stages[lowest][0]
    for s, whole in stages.items():
        for key in ("skipped_steps", "loss_scale", "lr_scheduler"):
            if not same_value(whole[0].get(key), first.get(key)):
                raise CheckpointError(
                    f"{shard_name(s, 0)}: {key} is {whole[0].get(key)!r}, "
                    f"{shard_name(lowest, 0)}'s {first.get(key)!r}: shards of different "
                    "checkpoints were mixed"
                )


def _settings(stages: Mapping[int, Sequence[dict]]) -> dict[str, Any] | None:
    """The one parameter group's settings every stage read (by stage) saved its optimizer
    with."""
    found: tuple[str, dict[str, Any]] | None = None
    for s, whole in sorted(stages.items()):
        optimizer = whole[0]["optimizer"]
        if optimizer is None:
            continue
        name = shard_name(s, 0)
        groups = optimizer["param_groups"]
        if len(groups) != 1:
            raise CheckpointError(
                f"{name}: its optimizer has {len(groups)} parameter groups; a checkpoint "
                "loads into another shape by parameter name, and parameter groups are "
                "positional: load it into the shape it was saved from"
            )
        settings = {key: value for key, value in groups[0].items() if key != "params"}
        if found is not None and not same_value(settings, found[1]):
            raise CheckpointError(
                f"{name}: optimizer settings {settings!r}, {found[0]}'s {found[1]!r}: stages "
                "with other settings cannot be merged into another shape"
            )
        found = found or (name, settings)
    return found[1] if found is not None else None


def export(directory: str | os.PathLike) -> dict[str, Any]:
    """The whole model's state dict from a checkpoint directory, or its manifest path
    (`schedcc.export`)."""
    directory = checkpoint_directory(directory)
    return dict(read_model(directory, read_checkpoint(directory)).tensors)
