"""1F1B with selective activation offloading (Wan et al. 2025, "PipeOffload: Improving
Scalability of Pipeline Parallelism with Memory Optimization", Sea AI Lab).

The compute order is 1F1B's (`schedules/one_f_one_b.py`). Each forward whose activations live
long enough to hide both copies moves them to host memory right after it runs (`O`) and brings
them back one compute before its backward (`L`): the copies run on the stage's copy lane while it
computes ([Note: offloading] in `schedcc.rules.offload`). That is PipeOffload's selective
offload: an activation whose lifespan covers its round trip costs no time to offload, and those
are the long-lived ones that make 1F1B's peak (stage s holds `p - s` at once); the short-lived
ones (the last stages') stay. Stage s then holds at most 2 activations on the device instead of
`min(p - s, m)` (the forward just run and the one reloaded for the next backward), and while a
copy takes at most a forward the makespan is 1F1B's (docs/performance.md, "Offloading
activations").

p = 4, m = 8, stage 0 (stage 3 offloads nothing: each backward follows its forward):

    F0 O0 F1 O1 F2 O2 L0 F3 O3 B0 L1 F4 O4 B1 L2 F5 O5 B2 L3 F6 O6 B3 L4 F7 O7 B4 L5 B5 ...
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

from schedcc.ir import Instruction
from schedcc.passes.insert_offload import attach_copies, offload_points
from schedcc.schedules.one_f_one_b import OneFOneB

__all__ = ["OneFOneBOffload"]


class OneFOneBOffload(OneFOneB):
    """1F1B whose long-lived activations go to host memory between their forward and backward."""

    name = "1f1b-offload"
    chunks: ClassVar[tuple[int, ...]] = (1,)

    def order(self, stage: int) -> Iterator[Instruction]:
        computes = tuple(super().order(stage))
        yield from attach_copies(
            computes, [a for pair in offload_points(computes).values() for a in pair]
        )
