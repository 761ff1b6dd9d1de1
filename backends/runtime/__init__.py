"""What each instruction does to tensors on one stage, shared by every backend.

`stage` holds `StageRuntime`; it delegates the stashed weight versions to `versions`, the
gradient reduction and ZeRO shards to `zero`, and data-parallel communication to the
`Collectives` of `collectives`.
"""

from schedcc.backends.runtime.stage import StageRuntime

__all__ = ["StageRuntime"]
