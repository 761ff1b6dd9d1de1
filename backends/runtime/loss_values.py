"""What a run reports per batch: its loss and named parts, read on the host or left on the device.

Both engines add a run's loss sums on the device into one float64 vector, `values`: the
`count` batches' totals, then their counts, then each batch's parts in `names` order. Where the
caller reads the loss (`train(..., read_loss=True)`, the default) the vector is read once
([Note: host syncs] in `backends.runtime.syncs`) and `read_losses` divides in Python; where it
does not (`read_loss=False`), `device_losses` divides on the device, with the same float64
divisions, so each tensor holds exactly the float a reading run returns.

[Note: an unread loss is a tensor] `read_loss=False` returns each step's loss as a 0-dim
float64 tensor on the device, as torch.distributed.pipelining's `schedule.step(...,
losses=losses)` appends its microbatches' loss tensors and Megatron-LM's
`forward_backward_func` returns its reduced losses as tensors: the caller decides when to pay
for a read (`.item()` every N steps, or `torch.stack(losses).mean().item()` once), and the read
is visibly theirs. A lazy float-like object was the alternative; it would hide where the sync
happens (any `print` or comparison would make one) and need its own type in every signature.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["device_losses", "read_losses"]


def read_losses(
    values: Sequence[float], count: int, names: Sequence[str]
) -> list[tuple[float, dict[str, float]]]:
    """Per batch, `(loss, parts)` from the read `values` (see the module docstring): total
    over count (NaN for a count of 0, without parts), and `{"loss": loss, name: part / count}`.
    """
    out = []
    width = len(names)
    for n in range(count):
        total, number = values[n], values[count + n]
        loss = total / number if number else math.nan
        named = values[2 * count + n * width :][:width] if number else []
        out.append((loss, {"loss": loss, **{k: v / number for k, v in zip(names, named)}}))
    return out


def device_losses(
    values: torch.Tensor, count: int, names: Sequence[str]
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Per batch, `(loss, parts)` as `read_losses` gives them, as 0-dim float64 tensors on
    `values`' device, read nowhere ([Note: an unread loss is a tensor]); a batch that counted
    nothing has NaN for its loss and each part."""
    totals, numbers = values[:count], values[count : 2 * count]
    counted = numbers != 0
    nan = values.new_full((), math.nan)
    losses = torch.where(counted, totals / numbers, nan)
    parts = values[2 * count :].view(count, len(names))
    parts = torch.where(counted[:, None], parts / numbers[:, None], nan)
    return [
        (losses[n], {"loss": losses[n], **{k: parts[n, i] for i, k in enumerate(names)}})
        for n in range(count)
    ]
