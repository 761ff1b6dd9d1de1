"""How a batch becomes microbatches, alike on both engines.

A batch is `(inputs, targets)`: each a boundary value (`backends.runtime.values`: a tensor, or
any nesting of tuple, list and dict of tensors and constants). Every tensor in it is split along
dim 0 into `m` equal microbatches (or, given `microbatch_sizes`, into `m` microbatches of those
sizes: `check_sizes`), constants are repeated, and every check raises a `ScheduleConfigError`
that names the batch (and the replica) before anything runs.

With data parallelism the local engine also takes one global batch, split into `dp` equal local
batches in order, or the `dp` local batches themselves: a sequence of `dp` items that are each a
two-item tuple or list. (A global batch whose inputs and targets are both two-item sequences
reads as local batches when `dp == 2`: pass it as a list of local batches instead.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from schedcc.backends.runtime.values import flatten, split, unflatten
from schedcc.errors import ScheduleConfigError

__all__ = [
    "batch_size",
    "check_sizes",
    "is_pair",
    "local_batches",
    "same_sizes",
    "split_pair",
    "to_device",
]


def is_pair(batch: Any) -> bool:
    """Whether `batch` is one `(inputs, targets)` pair: a tuple or list of two values."""
    return isinstance(batch, (tuple, list)) and len(batch) == 2


def batch_size(value: Any, name: str, where: str) -> int | None:
    """Dim 0 of the first tensor in `value` (None: it holds no tensor).

    Raises:
        ScheduleConfigError: that tensor has no dim 0; `where` starts the message.
    """
    try:
        tensors, _ = flatten(value, name=name)
    except ScheduleConfigError as exc:
        raise ScheduleConfigError(f"{where}: {exc}") from None
    if not tensors:
        return None
    if tensors[0].dim() == 0:
        got = "Tensor scalar" if isinstance(value, torch.Tensor) else "a 0-dim tensor first"
        raise ScheduleConfigError(
            f"{where}: {name} must be a tensor with a batch dimension (or a tuple, list or dict "
            f"of them), got {got}"
        )
    return tensors[0].shape[0]


def check_sizes(sizes: Any, m: int, *, where: str = "microbatch_sizes") -> tuple[int, ...]:
    """`sizes` as a tuple of `m` positive ints: how many samples each microbatch of a batch
    holds (`train_step(..., microbatch_sizes=...)`); their sum is checked against the batch in
    `split_pair`.

    Raises:
        ScheduleConfigError: not a sequence of ints, another count than `m`, or a size below 1.

    >>> check_sizes([1, 3, 2, 6], 4)
    (1, 3, 2, 6)
    >>> check_sizes([4, 0], 2)
    Traceback (most recent call last):
    ...
    schedcc.errors.ScheduleConfigError: microbatch_sizes[1] is 0: every microbatch needs at \
least one sample (give m=2 sizes of 1 or more)
    """
    try:
        items = list(sizes)
    except TypeError:
        items = None
    if items is None or isinstance(sizes, (str, bytes)):
        raise ScheduleConfigError(
            f"{where} must be a list of m={m} sample counts, one per microbatch, got "
            f"{type(sizes).__name__}"
        )
    for k, size in enumerate(items):
        if isinstance(size, bool) or not isinstance(size, int):
            raise ScheduleConfigError(
                f"{where}[{k}] is {size!r}, not an int: give the number of samples of each "
                "microbatch"
            )
    if len(items) != m:
        raise ScheduleConfigError(
            f"{where} gives {len(items)} sizes but the program splits a batch into m={m} "
            f"microbatches: give one size per microbatch (or compile with "
            f"num_microbatches={len(items)})"
        )
    for k, size in enumerate(items):
        if size < 1:
            raise ScheduleConfigError(
                f"{where}[{k}] is {size}: every microbatch needs at least one sample (give "
                f"m={m} sizes of 1 or more)"
            )
    return tuple(items)


def split_pair(
    inputs: Any,
    targets: Any,
    m: int,
    *,
    where: str,
    need_inputs: bool = True,
    sizes: Sequence[int] | None = None,
    parts: int = 1,
    seq_dim: int = 1,
) -> tuple[list[Any], list[Any]]:
    """The `m` microbatches of `inputs` and of `targets` (`where` starts every message, e.g.
    "batch 0 (replica 1)"), of `sizes` samples each where given (`check_sizes`). With
    `parts > 1` they are sequence parts ([Note: sequence parts] in `schedcc.rules.parts`): the
    batch is split into `m / parts` along dim 0 and each of those into `parts` along `seq_dim`,
    in that order.

    Raises:
        ScheduleConfigError: inputs without a tensor (when `need_inputs`), targets with another
            batch size than the inputs, a batch size that `m / parts` does not divide (or that
            `sizes` do not sum to), a tensor whose dim 0 differs from its value's batch size
            (named by its path), or one whose `seq_dim` `parts` does not divide.
    """
    if parts > 1:
        if sizes is not None:
            raise ScheduleConfigError(
                f"{where}: microbatch_sizes with sequence parts (num_parts={parts}): a part is a "
                "slice of every sample's sequence, so the parts of a microbatch are equal; give "
                "equal microbatches, or a schedule without parts"
            )
        xs, ys = split_pair(inputs, targets, m // parts, where=where, need_inputs=need_inputs)
        return (
            _parts(xs, parts, seq_dim, "inputs", where),
            _parts(ys, parts, seq_dim, "targets", where),
        )
    size = batch_size(inputs, "inputs", where)
    if size is None and need_inputs:
        raise ScheduleConfigError(
            f"{where}: inputs hold no tensor; a batch's inputs must hold at least one tensor "
            "with a batch dimension"
        )
    target_size = batch_size(targets, "targets", where)
    if size is not None and target_size is not None and size != target_size:
        raise ScheduleConfigError(
            f"{where}: inputs hold {size} samples but targets hold {target_size}: targets must "
            "have the same batch size (dim 0)"
        )
    size = size if size is not None else target_size
    if sizes is not None:
        sizes = check_sizes(sizes, m)
        if size is not None and sum(sizes) != size:
            raise ScheduleConfigError(
                f"{where}: microbatch_sizes {list(sizes)} sum to {sum(sizes)} but the batch "
                f"holds {size} samples: give sizes that add up to the batch size"
            )
    elif size is not None and size % m:
        raise ScheduleConfigError(
            f"{where}: {size} samples cannot be split into m={m} equal microbatches; make the "
            f"batch size a multiple of {m}, or give microbatch_sizes"
        )
    try:
        return (
            split(inputs, m, name="inputs", sizes=sizes),
            split(targets, m, name="targets", sizes=sizes),
        )
    except ScheduleConfigError as exc:
        raise ScheduleConfigError(f"{where}: {exc}") from None


def _parts(values: list[Any], parts: int, seq_dim: int, name: str, where: str) -> list[Any]:
    """Each of `values` cut into `parts` equal pieces along `seq_dim` of every tensor, in order
    (constants repeated); the pieces are views."""
    out = []
    for value in values:
        tensors, spec = flatten(value, name=name)
        pieces = []
        for tensor in tensors:
            if not -tensor.dim() <= seq_dim < tensor.dim() or tensor.shape[seq_dim] % parts:
                raise ScheduleConfigError(
                    f"{where}: {name} holds a tensor of shape {tuple(tensor.shape)}, which does "
                    f"not split into {parts} equal sequence parts along seq_dim={seq_dim}; make "
                    f"that dim a multiple of {parts}, or choose seq_dim= of the schedule"
                )
            pieces.append(tensor.chunk(parts, dim=seq_dim))
        out.extend(unflatten([p[j] for p in pieces], spec) for j in range(parts))
    return out


def local_batches(batch: Any, index: int, data_parallel: int) -> list[tuple[Any, Any]]:
    """The `(inputs, targets)` of each data-parallel replica (see the module docstring).

    Raises:
        ScheduleConfigError: `batch` is neither form, or a global batch does not split into
            `data_parallel` equal local batches.
    """
    dp = data_parallel
    if (
        dp > 1
        and isinstance(batch, (tuple, list))
        and len(batch) == dp
        and all(map(is_pair, batch))
    ):
        return [tuple(local) for local in batch]  # type: ignore[misc]
    if not is_pair(batch):
        raise ScheduleConfigError(
            f"batch {index} must be (inputs, targets) tensors or values"
            + (f", or a sequence of {dp} such local batches" if dp > 1 else "")
        )
    inputs, targets = batch
    if dp == 1:
        return [(inputs, targets)]
    size = batch_size(inputs, "inputs", f"batch {index}")
    if size is None or size % dp:
        raise ScheduleConfigError(
            f"batch {index}: {size or 0} samples cannot be split into data_parallel={dp} equal "
            "local batches"
        )
    return list(zip(split(inputs, dp, name="inputs"), split(targets, dp, name="targets")))


def to_device(value: Any, device: torch.device) -> Any:
    """`value` with every tensor on `device` (the value itself when all are there)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    tensors, spec = flatten(value)
    if all(t.device == device for t in tensors):
        return value
    return unflatten([t.to(device) for t in tensors], spec)


def same_sizes(locals_: Sequence[tuple[Any, Any]], index: int) -> None:
    """Raise unless every replica's local batch holds the same number of samples."""
    sizes = {batch_size(x, "inputs", f"batch {index}") for x, _ in locals_}
    if len(sizes) > 1:
        raise ScheduleConfigError(
            f"batch {index}: the local batches hold {sorted(sizes, key=str)} samples; every "
            "data-parallel replica needs the same local batch size"
        )
