"""What a recomputed forward keeps, for `StageRuntime`: its input and its RNG state.

[Note: recomputation] (docs/design.md) A forward whose stage runs a `Recompute` of it runs with
saved-tensor hooks that keep nothing (its outputs still take a gradient, so the next segment's
input does, but no activation stays behind), and keeps only what `R` needs to run it again: the
input value and its grad-requiring leaves, the parameter tensors it ran with, and the RNG states
(CPU, and each CUDA device it touched) it started from. `R` replays the forward on those RNG
states inside `torch.random.fork_rng`, so dropout draws the same masks and the RNG stream that
later forwards see is the one they would have seen without recomputation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from schedcc.backends.runtime.values import flatten
from schedcc.errors import RuntimeInstructionError

__all__ = ["KeptInput", "RngState", "input_bytes", "keeping_nothing", "replaying"]


class RngState:
    """The CPU RNG state and that of each CUDA device in `devices`, taken now."""

    __slots__ = ("cpu", "cuda", "devices")

    def __init__(self, devices: Iterable[int]) -> None:
        self.devices = sorted(set(devices))
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]

    @classmethod
    def of(cls, params: Iterable[torch.Tensor], value: Any) -> RngState:
        """The RNG states a forward on `params` and `value` can draw from."""
        tensors, _ = flatten(value)
        devices = {t.device.index for t in (*params, *tensors) if t.is_cuda}
        return cls(d if d is not None else torch.cuda.current_device() for d in devices)


class KeptInput:
    """What a forward that keeps only its input leaves for its `Recompute`."""

    __slots__ = ("leaves", "num_bytes", "params", "rng", "value")

    def __init__(self, value: Any, leaves: list, params: dict, rng: RngState) -> None:
        self.value, self.leaves, self.params, self.rng = value, leaves, params, rng
        #: the bytes of the input's tensors (a view counts its own bytes, as saved tensors do)
        self.num_bytes = input_bytes(value)


def input_bytes(value: Any) -> int:
    """The bytes of the tensors in a boundary value (each distinct tensor once)."""
    tensors, _ = flatten(value)
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
    return sum(seen.values())


def _keep_nothing(tensor: torch.Tensor) -> None:
    return None


def _nothing_kept(_: None) -> torch.Tensor:
    raise RuntimeInstructionError(
        "a backward reached a forward that kept only its input: its Recompute must run first"
    )


@contextmanager
def keeping_nothing() -> Iterator[None]:
    """Autograd records the graph (outputs take a gradient) but saves no tensor for it."""
    with torch.autograd.graph.saved_tensors_hooks(_keep_nothing, _nothing_kept):
        yield


@contextmanager
def replaying(state: RngState) -> Iterator[None]:
    """Run on the RNG states in `state`; the RNG states before are back afterwards."""
    with torch.random.fork_rng(devices=state.devices):
        torch.set_rng_state(state.cpu)
        for device, cuda in zip(state.devices, state.cuda):
            torch.cuda.set_rng_state(cuda, device)
        yield
