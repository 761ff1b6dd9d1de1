"""What each instruction does to tensors on one stage, shared by every backend.

`stage` holds `StageRuntime`, one short handler per instruction; the modules beside it hold what
the handlers need (docs/design.md lists them): the weight versions, the gradient reduction and
ZeRO shards, the graphs forwards leave, the losses and their count, the gradient norm, and
data-parallel communication through the `Collectives` of `collectives`.
"""

from schedcc.backends.runtime.stage import StageRuntime

__all__ = ["StageRuntime"]
