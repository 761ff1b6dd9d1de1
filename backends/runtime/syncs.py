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

import torch

__all__ = ["HostSyncs", "host_read"]


class HostSyncs:
    """How many host reads the point-to-point of this process has made (`count`)."""

    count = 0


def host_read(tensor: torch.Tensor) -> list:
    """`tensor`'s values as a Python list, counted in `HostSyncs.count`."""
    HostSyncs.count += 1
    return tensor.tolist()
