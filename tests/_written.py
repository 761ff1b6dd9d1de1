"""Hand-written programs: schedules that yield every instruction, so the compiler inserts none.

`written(*stages)` is a schedule whose stage `s` yields exactly the instructions of the text
`stages[s]`, in `schedcc.ir` form (`"F0 RG0 SA0 B0 Step"`). `CLASS_A` is the smallest
case of a comm group that must be posted whole: stage 0's `[RG0 SA0]` only completes if its send is
posted before its receive is waited on.
"""

from __future__ import annotations

from schedcc import Schedule
from schedcc.ir import parse

__all__ = ["CLASS_A", "Written", "written"]

#: gpipe p=2 m=1: stage 0 receives the gradient and sends the activation in one comm group.
CLASS_A = ("F0 RG0 SA0 B0 Step", "RA0 F0 B0 SG0 Step")


class Written(Schedule):
    """Yields the instructions of `texts[stage]`, in order."""

    name = "written"
    texts: tuple[str, ...] = ()

    def order(self, stage: int):
        return [parse(token) for token in self.texts[stage].split()]

    def __repr__(self) -> str:
        return f"written({' / '.join(self.texts)})"


def written(*stages: str, num_microbatches: int = 1, num_batches: int = 1) -> Written:
    """The schedule whose stage `s` yields exactly `stages[s]`."""
    cls = type("Written", (Written,), {"texts": tuple(stages)})
    return cls(len(stages), num_microbatches, num_batches=num_batches)
