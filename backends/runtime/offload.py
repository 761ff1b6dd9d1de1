"""Saved activations that move to host memory and back, for `StageRuntime`'s `O` and `L`.

[Note: offloading in the runtime] ([Note: offloading] in `schedcc.rules.offload` says what the
program means.) A forward its stage offloads runs with saved-tensor hooks that keep each saved
tensor (parameters aside: they are weights, not activations) in a `_Slot`, and the backward
reads the slots. `Offload` swaps every slot's tensor for a host copy, `Reload` for a device copy
again; the copies are exact, so the backward computes what it would have. Under CUDA the host
copy is pinned and both copies run on one side stream per stage (the copy lane): the copy
stream waits for the forward's kernels, the device memory is released only once the copy has
read it (`record_stream`), and the first backward piece waits for its reload's event, so the
host never waits. On the CPU the host copies are a separate pool of tensors, so that the device
bytes the runtime measures (`Graphs.num_bytes`) drop at `O` and come back at `L`, as the bytes
model counts them, and the host bytes (`Graphs.host_bytes`) the other way.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["CopyLane", "OffloadedSaved"]


class _Slot:
    """One saved tensor of an offloaded forward: on the device, or its host copy."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class OffloadedSaved:
    """The saved tensors of one offloaded forward; `pack` and `unpack` are its hooks.

    >>> saved = OffloadedSaved([])
    >>> x = torch.ones(3, requires_grad=True)
    >>> with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
    ...     y = (x * x).sum()
    >>> lane = CopyLane()
    >>> lane.offload(saved); saved.slots[0].tensor is x
    False
    >>> lane.reload(saved); y.backward(); x.grad
    tensor([2., 2., 2.])
    """

    __slots__ = ("_by_key", "_skip", "device", "event", "on_host", "slots")

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._skip = {p.untyped_storage().data_ptr() for p in params}
        self._by_key: dict[tuple, _Slot] = {}  # a tensor saved twice is copied once
        self.slots: list[_Slot] = []
        self.on_host = False
        #: under CUDA, the copy lane's event the next backward piece waits for, and its device
        self.event: torch.cuda.Event | None = None
        self.device: torch.device | None = None

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _Slot:
        if tensor.untyped_storage().data_ptr() in self._skip:
            return tensor  # a parameter stays where it is
        key = (tensor.data_ptr(), tensor.size(), tensor.stride(), tensor.dtype)
        slot = self._by_key.get(key)
        if slot is None:
            slot = self._by_key[key] = _Slot(tensor.detach())
            self.slots.append(slot)
        return slot

    @staticmethod
    def unpack(saved: torch.Tensor | _Slot) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Slot) else saved

    def ready(self) -> None:
        """Before a backward piece reads the tensors: wait for the reload (CUDA)."""
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            self.event = None


class CopyLane:
    """One stage's copies between the device and the host (a side stream per CUDA device)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def offload(self, saved: OffloadedSaved) -> None:
        """Every slot's tensor to the host (see [Note: offloading in the runtime])."""
        for slot in saved.slots:
            device = slot.tensor
            if device.is_cuda:
                slot.tensor = self._to_host_cuda(device)
            else:
                slot.tensor = torch.empty_like(device).copy_(device)
        saved.on_host = True

    def reload(self, saved: OffloadedSaved, device: torch.device | None = None) -> None:
        """Every slot's tensor back to `device` (the CPU: a copy out of the host pool)."""
        event = None
        for slot in saved.slots:
            host = slot.tensor
            if device is not None and device.type == "cuda":
                slot.tensor, event = self._to_device_cuda(host, device)
            else:
                slot.tensor = torch.empty_like(host).copy_(host)
        saved.on_host = False
        saved.event, saved.device = event, device

    # -- CUDA: pinned host memory on a side stream ----------------------------------------------

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _to_host_cuda(self, tensor: torch.Tensor) -> torch.Tensor:
        stream = self._stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the forward wrote it
        with torch.cuda.stream(stream):
            host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # its memory is reused only once the copy has read it
        return host

    def _to_device_cuda(
        self, host: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.cuda.Event]:
        stream = self._stream(device)
        with torch.cuda.stream(stream):
            tensor = torch.empty(host.size(), dtype=host.dtype, device=device)
            tensor.copy_(host, non_blocking=True)
            event = stream.record_event()
        tensor.record_stream(torch.cuda.current_stream(device))  # the backward reads it there
        return tensor, event
