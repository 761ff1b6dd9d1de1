"""The `torch.distributed` backend: one process per (data-parallel rank, stage).

`engine` holds `Engine`, the per-rank driver; `groups` sets up the process groups and this stage's
segments; `eager` plans where each transfer is posted and waited and `transfers` posts them;
`streams` orders the messages of each channel and says when a header must travel, `wire` encodes
that header, `peers` sends a message over each transport, and `shm` carries them through shared
memory between stages on one machine; `ties` finds the parameters a rank shares with another's.
"""

from schedcc.backends.distributed.engine import Engine
from schedcc.backends.distributed.groups import Groups

__all__ = ["Engine", "Groups"]
