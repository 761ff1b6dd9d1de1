"""The one place the engines read device data on the host, or wait for a device, in a run.

[Note: host syncs] On CUDA, reading a tensor's values into Python (`.tolist()`, `.item()`,
`.cpu()`) waits for every kernel queued before it: the CPU stops running ahead of the GPU, and
the GPU's queue runs dry until the CPU queues more. Every such read in a training run goes
through `host_read` (or `read_within`, the same read bounded by a timeout), which counts it in
`HostSyncs.count`, so a test can assert how many a step makes on the CPU (where the same code
runs) and `benchmarks/gpu_check.py` can compare the count with `torch.cuda.set_sync_debug_mode`'s.
What remains on the per-step path, and why:

- the losses, once per run at its end, where the caller reads them (`train(...)`'s default,
  `read_loss=True`): the local engine's one read of every batch's sums, the distributed
  engine's one read of the reduced sums (`read_within`). With `read_loss=False` nothing is
  read: each step's loss stays a 0-dim float64 tensor on the device
  (`backends.runtime.loss_values.device_losses`), and the caller's own `.item()` is the sync;
- `GradNorm` reads the norm it decides on (skip a non-finite step, clip, float16's loss
  scale): an optimizer step that may or may not happen cannot be queued without knowing which;
  a program without `GradNorm` reads nothing for it;
- `ReduceTied` reads whether a tie has a gradient anywhere on its group (a tie no copy has a
  gradient of keeps none, as autograd would), once per instruction, and only on a stage where
  no copy of the tie has one ([Note: a tie's gradient known here] in `backends.runtime.tied`):
  a tied embedding and head that both get gradients read nothing;
- the NCCL path reads a message's header only when the receiver cannot know the message's
  shapes ([Note: certain shapes] in `backends.distributed.peers`): the first message of a
  channel for new input shapes, or every message under `dynamic_shapes`.

So a steady step of a program without `GradNorm` (whose ties get gradients on every stage) makes
one counted read when the loss is read and none when it is not (tests/distributed/
test_nccl_path.py counts both on the NCCL path, tests/engine/test_unread_loss.py on the local
engine). Not reads, not counted: the once-per-run check of the batches (a gloo all-reduce of CPU
flags) and the learning rate (a Python number). Scalars that join device tensors are made on the
device (`torch.full`) or kept as 0-dim CPU tensors that a kernel takes as an argument, never
copied with `torch.tensor(x, device=...)`, which waits for the stream. A batch given on the CPU
is copied to the device with torch's ordinary (stream-synchronising) copy: give CUDA batches to
avoid it.

[Note: one run ahead] A run's end on CUDA waits for the GPU only as far as it must. A run that
reads its loss waits for its own end anyway (the read needs it); `read_within` polls an event
recorded after the last kernel the read needs, so a peer that died or stopped (whose NCCL
kernels never end) becomes the engine's timeout and its one-line `RankFailure`, before NCCL's
watchdog (set `WATCHDOG_GRACE_S` later) tears the process down. A run that reads nothing records
an event at its end and waits, polling within the same timeout, for the event recorded at the
end of the previous such run (`RunEnds.pace`): the host stays at most one run ahead of the GPU,
so memory queued for later runs stays bounded and a dead peer is still seen, while the GPU's
queue never runs dry (this run's kernels are still queued when the wait returns). The wait is
not counted: it reads nothing and drains nothing (`set_sync_debug_mode` does not report an
event query either). `wait_device` drains the queue (counted): `predict` ends so, returning
outputs that are ready.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["WATCHDOG_GRACE_S", "HostSyncs", "RunEnds", "host_read", "read_within", "wait_device"]


class HostSyncs:
    """How many host reads and device drains this process has made (`count`)."""

    count = 0


def host_read(tensor: torch.Tensor) -> list:
    """`tensor`'s values as a Python list, counted in `HostSyncs.count`."""
    HostSyncs.count += 1
    return tensor.tolist()


#: Seconds the NCCL watchdog of the engine's own groups waits beyond the engine's timeout, so
#: the engine's `RankFailure` is the line a stuck run ends with (see [Note: one run ahead]).
WATCHDOG_GRACE_S = 30.0


def read_within(tensor: torch.Tensor, seconds: float) -> list | None:
    """`tensor`'s values as a Python list once its kernels have run, waiting (polling) at most
    `seconds` for them on CUDA; None if they have not. One read, counted ([Note: one run
    ahead])."""
    if tensor.device.type == "cuda":
        event = _record(tensor.device)
        if not _waited(event, time.monotonic() + seconds):
            return None
    return host_read(tensor)


def wait_device(device: torch.device, seconds: float) -> bool:
    """Wait until everything queued so far on `device`'s current stream has run, for at most
    `seconds`; whether it has. On the CPU there is nothing to wait for. A drain, counted
    ([Note: one run ahead])."""
    if device.type != "cuda":
        return True
    if not _waited(_record(device), time.monotonic() + seconds):
        return False
    HostSyncs.count += 1
    return True


class RunEnds:
    """The events recorded at the end of the last run that read nothing, one per CUDA device:
    what the next such run's end waits for ([Note: one run ahead]).

    Args:
        record: `record(device) -> event` (an object with `query() -> bool`): an event recorded
            on the device's current stream now; the default makes a `torch.cuda.Event`.
    """

    def __init__(self, record: Callable[[torch.device], Any] | None = None) -> None:
        self._record = record or _record
        self._previous: dict[torch.device, Any] = {}

    def pace(self, devices: Iterable[torch.device], seconds: float) -> bool:
        """At the end of a run that reads nothing: mark it on each CUDA device of `devices`,
        and wait (polling, at most `seconds` in all) until the previous run's marks have
        passed; whether they have. Nothing on the CPU."""
        now = {d: self._record(d) for d in dict.fromkeys(devices) if d.type == "cuda"}
        previous, self._previous = self._previous, now
        deadline = time.monotonic() + seconds
        return all(_waited(event, deadline) for d, event in previous.items() if d in now)


def _record(device: torch.device) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _waited(event: Any, deadline: float) -> bool:
    """Poll `event` until it has passed (True) or `deadline` (`time.monotonic()`) (False)."""
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True
