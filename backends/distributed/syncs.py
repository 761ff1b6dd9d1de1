"""The one place the distributed engine's point-to-point reads device data on the host.

[Note: host syncs] On CUDA, reading a tensor's values into Python (`.tolist()`, `.item()`,
`.cpu()`) waits for every kernel queued before it: the CPU stops running ahead of the GPU. The
NCCL path reads only a message's header, and only when the receiver cannot know the message's
shapes ([Note: certain shapes] in `backends.distributed.peers`): the first message of a channel
with new input shapes. Every such read goes through `host_read`, which counts it, so a test can
assert how many a step makes on the CPU (where the same code runs) and `gpu_check` can compare
the count with `torch.cuda.set_sync_debug_mode`'s.
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
