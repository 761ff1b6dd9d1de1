"""Does a checkpoint's optimizer state fit this optimizer: its settings, and each parameter's
state as it will be loaded.

[Note: the optimizer's own check] `torch.optim.Optimizer.load_state_dict` checks only the
number of groups and parameters; a setting of another type or range (an `lr` of "abc" or -1,
`betas` of one number) or a state without one of its names (Adam's `exp_avg`) loads, and the
next step fails or trains wrongly. The optimizer itself knows what it accepts, so before
loading, one step of a scratch optimizer of the same class is taken on a one-element parameter
of the model's dtype and device, built with the checkpoint's settings: its constructor checks
their ranges (torch's optimizers refuse a negative `lr`, `eps` or `weight_decay`, `betas`
outside [0, 1)), and its state names are what every parameter's saved state must hold —
those it keeps per element as tensors of the parameter's shape and dtype, the others (Adam's
`step`) as scalars. This holds for the elementwise optimizers a checkpoint can re-shard (SGD,
Adam, AdamW, ...: [Note: elastic resume] in `backends.checkpoint.state`). An optimizer that
cannot be built that way with its own current settings (a custom one with other constructor
arguments, or a step that needs a closure) is not probed: its state must then hold the same
names for every parameter, and those of its current state where it has one.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch

from schedcc.backends.checkpoint.schema import describe
from schedcc.errors import CheckpointError

__all__ = ["check_numbering", "check_settings", "check_state", "probe_state"]


def check_settings(name: str, saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Raise `CheckpointError` unless the parameter groups of `saved` (a shard's optimizer
    state, of the schema's form) have this optimizer's settings: the same names, each of the
    same kind (a bool for a bool, a finite number for a finite number, ...), and its
    parameters numbered as `state_dict` numbers them (0, 1, ... over the groups in order, the
    state keyed by those numbers: re-sharding reads them so)."""
    check_numbering(name, saved)
    groups = [set(g) - {"params"} for g in optimizer.param_groups]
    old = [set(g) - {"params"} for g in saved["param_groups"]]
    if old != groups:
        raise CheckpointError(
            f"{name}: the optimizer was another kind, or grouped otherwise: parameter groups "
            f"with {[sorted(g) for g in old]}, this optimizer's {[sorted(g) for g in groups]}"
        )
    for g, (group, current) in enumerate(zip(saved["param_groups"], optimizer.param_groups)):
        for key in sorted(groups[g]):
            if not _same_kind(group[key], current[key]):
                raise CheckpointError(
                    f"{name}: optimizer param_groups[{g}][{key!r}] is {group[key]!r}, not of "
                    f"the kind of this optimizer's {current[key]!r}: it was altered"
                )


def check_numbering(name: str, saved: dict[str, Any]) -> None:
    """Raise `CheckpointError` unless the optimizer state `saved` numbers its parameters 0, 1,
    ... over its groups in order, and holds state only for those."""
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    if ids != list(range(len(ids))):
        raise CheckpointError(
            f"{name}: optimizer param_groups number the parameters {ids}, not 0 to "
            f"{len(ids) - 1} in order as a saved state does: it was altered"
        )
    stray = sorted(set(saved["state"]) - set(ids))
    if stray:
        raise CheckpointError(
            f"{name}: optimizer state holds parameter {stray[0]}, which is none of its "
            f"param_groups' {ids}: it was altered"
        )


def check_state(
    where: str,
    target: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    *,
    like: Sequence[torch.Tensor] | None = None,
) -> None:
    """Raise `CheckpointError` unless `target` (the state dict that will be loaded) loads into
    `optimizer` whole: its groups of this optimizer's sizes, settings it accepts, and each
    parameter's state of the names and kinds a step gives, per element of its parameter's
    shape and dtype. With `like` (per parameter, a tensor of its shape and dtype: `meta` will
    do), check a saved state in the layout it was saved in instead, before it is re-sharded."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    lengths = [len(g["params"]) for g in target["param_groups"]]
    if like is None and lengths != [len(g["params"]) for g in optimizer.param_groups]:
        raise CheckpointError(
            f"{where}: the checkpoint's optimizer groups hold {lengths} parameters, this "
            f"optimizer's {[len(g['params']) for g in optimizer.param_groups]}"
        )
    if like is not None and sum(lengths) != len(like):
        raise CheckpointError(
            f"{where}: the checkpoint's optimizer groups hold {lengths} parameters, the layout "
            f"it was saved in {len(like)}"
        )
    params = list(like) if like is not None else params
    ids = [i for g in target["param_groups"] for i in g["params"]]
    index = {i: position for position, i in enumerate(ids)}
    if len(index) != len(ids):
        raise CheckpointError(f"{where}: the checkpoint's optimizer names a parameter twice")
    group_of = [g for g, group in enumerate(target["param_groups"]) for _ in group["params"]]
    probes = [
        probe_state(where, optimizer, g, group) for g, group in enumerate(target["param_groups"])
    ]
    names = {frozenset(entry) for entry in target["state"].values()}
    for key, entry in target["state"].items():
        if key not in index:
            raise CheckpointError(
                f"{where}: the checkpoint's optimizer holds state for {key!r}, which is none of "
                "its parameters"
            )
        position = index[key]
        _check_entry(where, position, entry, params[position], probes[group_of[position]])
    now = {frozenset(entry) for entry in optimizer.state.values()}
    if not any(probes) and (len(names) > 1 or (now and names and now != names)):
        raise CheckpointError(
            f"{where}: the checkpoint's optimizer state holds {sorted(map(sorted, names))}, "
            f"this optimizer's {sorted(map(sorted, now))}: the optimizer was another kind, or "
            "it was altered"
        )


def probe_state(
    where: str, optimizer: torch.optim.Optimizer, g: int, group: dict[str, Any]
) -> dict[str, str] | None:
    """Per state name, the kind of value (`_kind`) that one step of an optimizer of this class
    with the settings of `group` keeps for a parameter of group `g`'s dtype and device; None
    where this optimizer cannot be built from its own settings ([Note: the optimizer's own
    check]).

    Raises:
        CheckpointError: the optimizer refuses the settings of `group`, naming the setting.
    """
    params = optimizer.param_groups[g]["params"]
    if not params:
        return None
    current = optimizer.param_groups[g]
    try:
        _step_once(optimizer, current, params[0])
    except Exception:  # the user's optimizer class: any failure means no probe
        return None
    try:
        state = _step_once(optimizer, group, params[0])
    except Exception as exc:  # the optimizer's own refusal of a setting
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{where}: {type(optimizer).__name__} refuses the checkpoint's optimizer "
            f"{_culprit(optimizer, g, group, params[0])} ({text}): it was altered"
        ) from None
    return {name: _kind(value) for name, value in state.items()}


def _culprit(optimizer: torch.optim.Optimizer, g: int, group: dict[str, Any], like) -> str:
    """The first setting of `group` the optimizer refuses in place of its own, as a field."""
    current = optimizer.param_groups[g]
    for key in sorted(set(group) - {"params"}):
        try:
            _step_once(optimizer, {**current, key: group[key]}, like)
        except Exception:  # the one refused
            return f"param_groups[{g}][{key!r}] = {group[key]!r}"
    return f"settings of param_groups[{g}]"


def _step_once(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], like: torch.Tensor
) -> dict[str, Any]:
    """The state one step of a new optimizer of `optimizer`'s class, with `group`'s settings,
    gives a one-element parameter like `like` (a zero gradient: nothing else is touched)."""
    cls = type(optimizer)
    accepted = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    settings = {
        key: value
        for key, value in group.items()
        if key != "params" and (takes_any or key in accepted)
    }
    param = torch.nn.Parameter(torch.zeros(1, dtype=like.dtype, device=like.device))
    param.grad = torch.zeros_like(param)
    scratch = cls([param], **settings)
    scratch.step()
    return dict(scratch.state[param])


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "a tensor of the parameter's shape" if value.dim() > 0 else "a 0-dim tensor"
    if value is None:
        return "None"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "a number"
    return f"a {type(value).__name__}"


_PER_ELEMENT = "a tensor of the parameter's shape"


def _check_entry(
    where: str,
    position: int,
    entry: dict[str, Any],
    param: torch.Tensor,
    probe: dict[str, str] | None,
) -> None:
    """One parameter's state: the probe's names and kinds, per-element ones of its shape and
    dtype (without a probe: each tensor of more than 0 dimensions is per element)."""
    if probe is not None and entry.keys() != probe.keys():
        raise CheckpointError(
            f"{where}: the optimizer state of parameter {position} holds {sorted(entry)}, a "
            f"step of this optimizer {sorted(probe)}: it was altered, or the optimizer was "
            "another kind"
        )
    for name, value in entry.items():
        what = f"{where}: optimizer state {name!r} of parameter {position}"
        kind = probe[name] if probe is not None else _kind(value)
        if kind == _PER_ELEMENT:
            _check_per_element(what, value, param)
        elif _kind(value) != kind:
            raise CheckpointError(f"{what} is {describe(value)}, not {kind}")


def _check_per_element(what: str, value: Any, param: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{what} is {describe(value)}, not a tensor")
    if value.shape != param.shape:
        raise CheckpointError(
            f"{what} has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}"
        )
    if value.dtype != param.dtype:
        raise CheckpointError(f"{what} is {value.dtype}, the parameter {param.dtype}")


def _same_kind(value: Any, current: Any) -> bool:
    """`value` may stand for the setting `current`: a bool for a bool, a bool or None for
    None, a number (finite where `current` is) for a number, a tensor of its shape for a
    tensor, a sequence of as many items of their kinds for a sequence, a name for a name."""
    if current is None:
        return value is None or isinstance(value, bool)
    if isinstance(current, bool):
        return isinstance(value, bool)
    if isinstance(current, (int, float)):
        return (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and (math.isfinite(value) or not math.isfinite(current))
        )
    if isinstance(current, torch.Tensor):
        return (
            isinstance(value, torch.Tensor)
            and value.shape == current.shape
            and (_finite(value) or not _finite(current))
        )
    if isinstance(current, (tuple, list)):
        return (
            isinstance(value, (tuple, list))
            and len(value) == len(current)
            and all(_same_kind(v, c) for v, c in zip(value, current))
        )
    return type(value) is type(current)


def _finite(tensor: torch.Tensor) -> bool:
    return not tensor.dtype.is_floating_point or bool(torch.isfinite(tensor).all())
