"""The schema of a checkpoint shard: every field a shard holds, its type and its range.

A shard file holds what `StageState.state_dict` returns and the RNG states the engines add
(`backends.checkpoint.state`). `check_shard` checks one shard against the table `SHARD` (and,
under ZeRO-3, `ZERO3`) field by field; `check_stage_shards` checks that a stage's shards agree
where every data-parallel rank records the same thing. Both are the model-free part of the first
phase of [Note: refuse before changing anything] (`backends.checkpoint.files`); whether the
tensors fit this engine's model and optimizer is `backends.checkpoint.restore`'s part.

[Note: a shard's schema] A shard holds exactly the fields of `SHARD` (and under `zero=3` those
of `ZERO3`): a missing or unknown field is refused, as is any value of another type or outside
its range. Counts are `int` (never `bool`) and >= 0; the loss scale a positive finite number;
every number the optimizer state records finite; tensors dense (strided). What a tensor holds
is data and is not judged (a diverged run's NaN weights load as they were saved), except where
its form is fixed: the CPU RNG state is a 1-D byte tensor. Each refusal is one `CheckpointError`
naming the file and the field as a path (`stage1-dp0.pt: loss_scale['scale'] is 'abc', not a
positive finite number`), so any edited field fails the same way, not only the ones a test
thought of.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from schedcc.errors import CheckpointError

__all__ = [
    "SHARD",
    "ZERO3",
    "Check",
    "check_shard",
    "check_stage_shards",
    "describe",
    "same_value",
]

#: A check: `check(value, field)` raises `_Bad` naming `field` where `value` does not fit.
Check = Callable[[Any, str], None]


class _Bad(Exception):
    """One field of a shard that does not fit its schema (turned into a `CheckpointError`)."""

    def __init__(self, field: str, value: Any, expected: str) -> None:
        if value is _MISSING:
            super().__init__(f"{field} is missing")
        else:
            super().__init__(f"{field} is {_show(value)}, not {expected}")


_MISSING = object()


# -- checks of one value -------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and type(value) is not bool


def _count(value: Any, field: str) -> None:
    if not (_is_int(value) and value >= 0):
        raise _Bad(field, value, "an integer >= 0")


def _positive_count(value: Any, field: str) -> None:
    if not (_is_int(value) and value >= 1):
        raise _Bad(field, value, "an integer >= 1")


def _zero_level(value: Any, field: str) -> None:
    if not (_is_int(value) and 0 <= value <= 3):
        raise _Bad(field, value, "a ZeRO level 0, 1, 2 or 3")


def _positive_finite(value: Any, field: str) -> None:
    if not (_is_number(value) and math.isfinite(value) and value > 0):
        raise _Bad(field, value, "a positive finite number")


def _name(value: Any, field: str) -> None:
    if not isinstance(value, str):
        raise _Bad(field, value, "a name (str)")


def _anything(value: Any, field: str) -> None:
    """A module's extra state: whatever its `get_extra_state` returned."""


def _tensor(*, dim: int | None = None, dtype: torch.dtype | None = None) -> Check:
    """A dense tensor, of `dim` dimensions and of `dtype` where given."""
    what = "a dense tensor" + (f" of {dim} dimension(s)" if dim is not None else "")
    what += f" of {dtype}" if dtype is not None else ""

    def check(value: Any, field: str) -> None:
        if (
            not isinstance(value, torch.Tensor)
            or value.layout != torch.strided
            or (dim is not None and value.dim() != dim)
            or (dtype is not None and value.dtype != dtype)
        ):
            raise _Bad(field, value, what)

    return check


def _state_value(value: Any, field: str) -> None:
    """One optimizer state value: a dense tensor (a 0-dim one finite), a finite number, None."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        _tensor()(value, field)
        if value.dim() == 0 and not _finite_tensor(value):
            raise _Bad(field, value, "a finite scalar")
        return
    if not (_is_number(value) and math.isfinite(value)):
        raise _Bad(field, value, "a tensor, a finite number or None")


def _param_state(value: Any, field: str) -> None:
    """One parameter's optimizer state: named values, its `step` (torch's optimizers' count of
    steps taken) a whole number >= 0."""
    _dict_of(_name, _state_value)(value, field)
    step = value.get("step")
    if step is None:
        return
    number = step.item() if isinstance(step, torch.Tensor) and step.dim() == 0 else step
    if not (_is_number(number) and number >= 0 and float(number).is_integer()):
        raise _Bad(f"{field}['step']", step, "a whole number of steps >= 0")


def _hyperparameter(value: Any, field: str) -> None:
    """A parameter group's setting: a bool, a number, a name, None, a tensor, or a tuple or
    list of those (its kind and range against this optimizer's: `backends.checkpoint.optimizer`)."""
    if value is None or isinstance(value, (bool, str)) or _is_number(value):
        return
    if isinstance(value, torch.Tensor):
        _tensor()(value, field)
        return
    if not isinstance(value, (tuple, list)):
        raise _Bad(field, value, "a bool, a number, a name, None or a tuple of those")
    for i, item in enumerate(value):
        _hyperparameter(item, f"{field}[{i}]")


def _finite_tensor(value: torch.Tensor) -> bool:
    if not (value.dtype.is_floating_point or value.dtype.is_complex):
        return True
    return bool(torch.isfinite(value).all())


# -- checks of containers ------------------------------------------------------------------------


def _list_of(item: Check) -> Check:
    """A list (or tuple) whose every item passes `item`."""

    def check(value: Any, field: str) -> None:
        if not isinstance(value, (list, tuple)):
            raise _Bad(field, value, "a list")
        for i, entry in enumerate(value):
            item(entry, f"{field}[{i}]")

    return check


def _pair(first: Check, second: Check) -> Check:
    """A list or tuple of two items, passing `first` and `second`."""

    def check(value: Any, field: str) -> None:
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise _Bad(field, value, "a pair")
        first(value[0], f"{field}[0]")
        second(value[1], f"{field}[1]")

    return check


def _dict_of(key: Check, item: Check) -> Check:
    """A dict whose every key passes `key` and every value `item`."""

    def check(value: Any, field: str) -> None:
        if not isinstance(value, dict):
            raise _Bad(field, value, "a dict")
        for k, entry in value.items():
            key(k, f"{field} key {k!r}")
            item(entry, f"{field}[{k!r}]")

    return check


def _record(fields: Mapping[str, Check], *, optional: Iterable[str] = ()) -> Check:
    """A dict of exactly `fields` (those in `optional` may be missing), each passing its check."""
    maybe = frozenset(optional)

    def check(value: Any, field: str) -> None:
        if not isinstance(value, dict):
            raise _Bad(field, value, f"a dict of {sorted(fields)}")
        _check_fields(value, fields, maybe, prefix=field)

    return check


def _optional(check: Check) -> Check:
    """None, or a value that passes `check`."""

    def maybe(value: Any, field: str) -> None:
        if value is not None:
            check(value, field)

    return maybe


def _group(value: Any, field: str) -> None:
    """One optimizer parameter group: its parameters' indices and its settings."""
    if not isinstance(value, dict) or "params" not in value:
        raise _Bad(field, value, "a parameter group (a dict with 'params')")
    for key, entry in value.items():
        _name(key, f"{field} key {key!r}")
        check = _list_of(_count) if key == "params" else _hyperparameter
        check(entry, f"{field}[{key!r}]")


def _check_fields(
    value: dict, fields: Mapping[str, Check], maybe: frozenset[str], *, prefix: str
) -> None:
    def where(key: Any) -> str:
        return f"{prefix}[{key!r}]" if prefix else str(key)

    unknown = [key for key in value if key not in fields]
    if unknown:
        raise _Bad(where(unknown[0]), value[unknown[0]], "a field of this format (unknown)")
    for key, check in fields.items():
        if key in value:
            check(value[key], where(key))
        elif key not in maybe:
            raise _Bad(where(key), _MISSING, "")


# -- the schema ----------------------------------------------------------------------------------

_LOSS_SCALE = _record({"scale": _positive_finite, "good": _count})

_OPTIMIZER = _record(
    {
        "state": _dict_of(_count, _param_state),
        "param_groups": _list_of(_group),
    }
)


def _lr_scheduler(value: Any, field: str) -> None:
    """A learning-rate scheduler's state: named values, its counts (`last_epoch`, the steps
    taken, and `_step_count`) whole numbers and its base rates finite numbers; what else a
    scheduler records is its own (checked against this engine's scheduler on load)."""
    _dict_of(_name, _anything)(value, field)
    checks = {"last_epoch": _count, "_step_count": _count, "base_lrs": _list_of(_finite_number)}
    for key, check in checks.items():
        if key not in value:
            raise _Bad(f"{field}[{key!r}]", _MISSING, "")
        check(value[key], f"{field}[{key!r}]")


def _finite_number(value: Any, field: str) -> None:
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if not (_is_number(value) and math.isfinite(value)):
        raise _Bad(field, value, "a finite number")


_BYTES = _tensor(dim=1, dtype=torch.uint8)

_RNG = _record({"cpu": _BYTES, "cuda": _list_of(_BYTES)}, optional=("cuda",))

#: Every field of a shard, and its check ([Note: a shard's schema]).
SHARD: dict[str, Check] = {
    "stage": _count,
    "rank": _count,
    "data_parallel": _positive_count,
    "segments": _list_of(_count),
    "zero": _zero_level,
    "numels": _list_of(_list_of(_count)),
    "modules": _list_of(_dict_of(_name, _anything)),
    "optimizer": _optional(_OPTIMIZER),
    "rng": _RNG,
    "skipped_steps": _count,
    "loss_scale": _optional(_LOSS_SCALE),
    "lr_scheduler": _optional(_lr_scheduler),
    "names": _list_of(_list_of(_name)),
}

#: The fields a shard holds besides `SHARD`'s when saved under `zero=3`
#: (`backends.checkpoint.sharded`).
ZERO3: dict[str, Check] = {
    "shards": _list_of(_tensor(dim=1)),
    "shapes": _list_of(_list_of(_pair(_name, _list_of(_count)))),
}

#: The fields every data-parallel rank of a stage records alike.
_ALIKE = (
    "stage",
    "data_parallel",
    "segments",
    "zero",
    "numels",
    "names",
    "skipped_steps",
    "loss_scale",
    "lr_scheduler",
)


def check_shard(name: str, state: Any) -> None:
    """Raise `CheckpointError` naming the file `name` and the field unless `state` holds
    exactly the fields of `SHARD` (and under `zero=3` of `ZERO3`), each of its type and range.

    Raises:
        CheckpointError: a field is missing, unknown, of another type or out of its range.
    """
    if not isinstance(state, dict):
        raise CheckpointError(f"{name} holds a {type(state).__name__}, not a shard's state")
    fields = dict(SHARD)
    if state.get("zero") == 3:
        fields.update(ZERO3)
    try:
        if "zero" in state:  # first: it decides which fields the others are
            _zero_level(state["zero"], "zero")
        _check_fields(state, fields, frozenset(), prefix="")
    except _Bad as exc:
        raise CheckpointError(
            f"{name}: {exc}: it was altered, or not written by this version of schedcc"
        ) from None


def check_stage_shards(names: Sequence[str], states: Sequence[dict[str, Any]]) -> None:
    """Raise `CheckpointError` unless a stage's shards (each passed `check_shard`), in rank
    order, record alike what every data-parallel rank records alike: the stage, the layout,
    the parameter sizes (under ZeRO-3 their names and shapes), the skipped steps, the loss
    scale, the learning-rate scheduler's state and the optimizer's settings."""
    first = states[0]
    keys = _ALIKE + (("shapes",) if first["zero"] == 3 else ())
    for name, state in zip(names[1:], states[1:]):
        for key in keys:
            if not same_value(state.get(key), first.get(key)):
                raise CheckpointError(
                    f"{name}: {key} is {_show(state.get(key))}, {names[0]}'s "
                    f"{_show(first.get(key))}: shards of different checkpoints were mixed"
                )
        for field, mine, theirs in _settings(state, first):
            if not same_value(mine, theirs):
                raise CheckpointError(
                    f"{name}: {field} is {_show(mine)}, {names[0]}'s {_show(theirs)}: shards "
                    "of different checkpoints were mixed"
                )


def _settings(state: dict[str, Any], first: dict[str, Any]) -> Iterator[tuple[str, Any, Any]]:
    """(field, this shard's, the first shard's) for each optimizer setting, and the groups."""
    if state["optimizer"] is None or first["optimizer"] is None:
        yield "optimizer", state["optimizer"], first["optimizer"]
        return
    mine, theirs = state["optimizer"]["param_groups"], first["optimizer"]["param_groups"]
    yield "optimizer param_groups settings", [sorted(g) for g in mine], [sorted(g) for g in theirs]
    for g, (group, other) in enumerate(zip(mine, theirs)):
        for key in sorted(set(group) - {"params"}):
            yield f"optimizer param_groups[{g}][{key!r}]", group[key], other.get(key)


def same_value(a: Any, b: Any) -> bool:
    """Equal, tensors by value (`==` on them is elementwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {tuple(value.shape)} {value.dtype}"
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"


def describe(value: Any) -> str:
    """A saved value as a refusal names it: a tensor's shape and dtype, else its type."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    return f"a {type(value).__name__}"
