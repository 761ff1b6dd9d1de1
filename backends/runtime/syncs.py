"""The one place the engines read device data on the host in a run.

[Note: host syncs] On CUDA, reading a tensor's values into Python (`.tolist()`, `.item()`,
`.cpu()`) waits for every kernel queued before it: the CPU stops running ahead of the GPU. A run
reads its losses once, at its end (`LossBook.records`, or the distributed engine's loss
reduction, which reads the reduced sums instead); the NCCL path reads a message's header only
when the receiver cannot know the message's shapes ([Note: certain shapes] in
`backends.distributed.peers`): the first message of a channel for new input shapes; `GradNorm`
reads the norm it decides on. Every such read goes through `host_read`, which counts it, so a
test can assert how many a step makes on the CPU (where the same code runs) and
`benchmarks/gpu_check.py` can compare the count with `torch.cuda.set_sync_debug_mode`'s.
"""

from __future__ import annotations

import time

import torch

__all__ = ["WATCHDOG_GRACE_S", "HostSyncs", "host_read", "wait_device"]


class HostSyncs:
    """How many host reads the point-to-point of this process has made (`count`)."""

    count = 0


def host_read(tensor: torch.Tensor) -> list:
    """`tensor`'s values as a Python list, counted in `HostSyncs.count`."""
    HostSyncs.count += 1
    return tensor.tolist()


#: Seconds the NCCL watchdog of the engine's own groups waits beyond the engine's timeout, so
#: the engine's `RankFailure` is the line a stuck run ends with (see `wait_device`).
WATCHDOG_GRACE_S = 30.0


def wait_device(device: torch.device, seconds: float) -> bool:
    """Wait until everything queued so far on `device`'s current stream has run, for at most
    `seconds`; whether it has. On the CPU there is nothing to wait for.

    On CUDA this is the one place a run waits for its GPU ([Note: host syncs]): it polls an
    event rather than blocking, so a peer that died or stopped (whose NCCL kernels never end)
    becomes the engine's timeout and its one-line `RankFailure`, before NCCL's watchdog (set
    `WATCHDOG_GRACE_S` later) tears the process down.
    """
    if device.type != "cuda":
        return True
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + seconds
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    HostSyncs.count += 1
    return True
