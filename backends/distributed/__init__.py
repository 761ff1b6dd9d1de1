"""The `torch.distributed` backend: one process per (data-parallel rank, stage).

`engine` holds `Engine`; `groups` sets up the process groups and this stage's segments, `shapes`
learns the shapes of point-to-point tensors, `eager` plans where each transfer is posted and
waited, `transfers` posts them, and `shm` carries them through shared memory between stages on
one machine.
"""

from schedcc.backends.distributed.engine import Engine

__all__ = ["Engine"]
