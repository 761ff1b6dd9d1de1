"""Mixed precision for `StageRuntime`: compute in a low precision, keep float32 master weights.

[Note: mixed precision] With `mixed_precision=torch.bfloat16` (or `torch.float16`) each segment
runs under `torch.autocast` in that dtype while its parameters stay in their own dtype (float32:
the master weights), so the optimizer steps and keeps its state in float32 and autograd delivers
float32 gradients, which the data-parallel and tied reductions sum in float32. What a segment
returns is cast to the low dtype before it crosses a stage (its floating tensors), so activations
and their gradients travel at half the bytes; the last segment's output is cast back to float32
for `loss_fn`. float16 also scales the loss ([Note: one norm, every stage alike] in
`backends.runtime.clipping`), which needs the program's `GradNorm`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["LOW_PRECISION", "Precision"]

#: The dtypes `mixed_precision` accepts.
LOW_PRECISION = (torch.bfloat16, torch.float16)


class Precision:
    """How a stage computes: in `dtype` under autocast (None: as the parameters are)."""

    def __init__(self, dtype: torch.dtype | None, device: torch.device | None) -> None:
        self.dtype = dtype
        self.device = device

    def compute(self) -> contextlib.AbstractContextManager:
        """The context a segment's forward runs in."""
        if self.dtype is None:
            return contextlib.nullcontext()
        kind = self.device.type if self.device is not None else "cpu"
        return torch.autocast(device_type=kind, dtype=self.dtype)

    def boundary(self, value: Any, *, last: bool = False) -> Any:
        """A segment's output as it leaves: floating tensors in the low dtype, or on the last
        segment back in float32 for the loss (differentiable casts)."""
        if self.dtype is None:
            return value
        target = torch.float32 if last else self.dtype

        def cast(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != target:
                if last and t.dtype not in LOW_PRECISION:
                    return t
                return t.to(target)
            return t

        return tree_map(cast, value)
