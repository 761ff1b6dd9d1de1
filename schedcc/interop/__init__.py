"""Interoperability with other pipeline runtimes.

`schedcc.interop.torch` speaks `torch.distributed.pipelining`'s schedule text: export a compiled
`Program` as per-rank action rows (`0F0`, `1SEND_F0`, `2B3`) or a CSV its runtime loads, and
import torch's built-in schedules or a user's CSV as a schedcc `Schedule` to validate, simulate
and draw. `schedcc.interop.torch_check` runs schedcc's checks on torch's own schedules (what
`schedcc verify --torch` prints). torch is imported lazily, inside the functions that need it.
"""

from __future__ import annotations

__all__: list[str] = []
