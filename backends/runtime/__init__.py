"""What each instruction does to tensors on one stage, shared by every backend.

`stage` holds `StageRuntime`; it delegates the stashed weight versions to `versions` and the
gradient reduction and ZeRO shards to `zero`.
"""

from schedcc.backends.runtime.stage import StageRuntime

__all__ = ["StageRuntime"]
