"""V-Half and V-Min (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory",
arXiv 2405.15362): V-shape schedules that trade a little bubble for a half or a third of 1F1B's
activation memory.

Two chunks per stage in a V, as in zb-v (segment k < p on stage k as chunk 0, segment k >= p on
stage 2p - 1 - k as chunk 1), backward split in I and W. Each microbatch repeats one *stable
pattern* every 6 time units (F = I = W = 1 per chunk): stage s starts its chunk-0 forward, its
chunk-1 forward, its chunk-1 input-backward and its chunk-0 input-backward at fixed offsets,
chosen so that the four never meet on a stage and each waits only for its neighbour's:

- V-Half: offsets `2s`, `3p - s - 2`, `3p + g + 2s - 1`, `6p + g - s - 2` with `g = 3` for even
  p (else 0); a microbatch is held about 3p units, so a stage holds about p chunk activations,
  half of 1F1B's 2p (two chunks of p microbatches).
- V-Min: offsets `s`, `2p - s - 1`, `2p + g + s`, `4p + g - s - 1` with `g = 2` when 3 divides p
  (else 0); about 2p/3 chunk activations, a third of 1F1B's.

Stage s runs its computes in the order of those times; each `W` fills the next idle unit after
its `I` (chunk 1's first), and the rest follow at the end, as in the paper's reference code.
schedcc then runs the order as soon as the data allows (what the paper calls squeezing), but
does not reorder the start-up greedily as that code does, so the start-up bubble is somewhat
larger than the paper's at small m.

Properties (F = I = W = 1 per chunk, any m >= 1): a stage holds at most 2*floor(p/2) + 2 chunk
activations under V-Half and 2*floor((p + 1)/3) + 2 under V-Min, against 2p for zb-v and for
1F1B (p microbatches of two chunks); p = 8: 10 and 8 against 16. The price is bubble: p = 4,
m = 8 takes 60 (V-Half) and 59 (V-Min) against zb-v's 51.

p = 4, m = 8 (`COLUMNS=100 schedcc show --schedule v-half -p 4 -m 8 -v 2`, one unit per column,
then the compute order per stage; `.1` marks chunk 1), V-Half:

    stage 0 |FF.....FFIWFFIW.FF.IIWFWFIIWFWFIIWFWFIIWFW.IIWFWIIWW.IW...IW|
    stage 1 |.FF...F..FFIWF.FIWIWFFIWIWFFIWIWFFIWIWFFIWIWFIWIW.IWIW...IW.|
    stage 2 |..F..FF..FF.IWFFIIWFWFIIWFWFIIWFWFIIWFWFIIWFW.IIWW.IIWW.IW..|
    stage 3 |...FF..FF..FFIWIWFFIWIWFFIWIWFFIWIWFFIWIWFFIWIW.IWIW.IWIW...|

    stage 0: F0 F1 F0.1 F2 I0.1 W0.1 F1.1 F3 I1.1 W1.1 F2.1 F4 I0 I2.1 W2.1 F3.1 W0 F5 I1 I3.1
             W3.1 F4.1 W1 F6 I2 I4.1 W4.1 F5.1 W2 F7 I3 I5.1 W5.1 F6.1 W3 I4 I6.1 W6.1 F7.1 W4
             I5 I7.1 W7.1 W5 I6 W6 I7 W7
    stage 1: F0 F1 F0.1 F2 F1.1 I0.1 W0.1 F3 F2.1 I1.1 W1.1 I0 W0 F4 F3.1 I2.1 W2.1 I1 W1 F5
             F4.1 I3.1 W3.1 I2 W2 F6 F5.1 I4.1 W4.1 I3 W3 F7 F6.1 I5.1 W5.1 I4 W4 F7.1 I6.1 W6.1
             I5 W5 I7.1 W7.1 I6 W6 I7 W7
    stage 2: F0 F0.1 F1 F1.1 F2 I0.1 W0.1 F2.1 F3 I0 I1.1 W1.1 F3.1 W0 F4 I1 I2.1 W2.1 F4.1 W1
             F5 I2 I3.1 W3.1 F5.1 W2 F6 I3 I4.1 W4.1 F6.1 W3 F7 I4 I5.1 W5.1 F7.1 W4 I5 I6.1
             W6.1 W5 I6 I7.1 W7.1 W6 I7 W7
    stage 3: F0 F0.1 F1 F1.1 F2 F2.1 I0.1 W0.1 I0 W0 F3 F3.1 I1.1 W1.1 I1 W1 F4 F4.1 I2.1 W2.1
             I2 W2 F5 F5.1 I3.1 W3.1 I3 W3 F6 F6.1 I4.1 W4.1 I4 W4 F7 F7.1 I5.1 W5.1 I5 W5 I6.1
             W6.1 I6 W6 I7.1 W7.1 I7 W7

and V-Min:

    stage 0 |FF.....FIWF..FIIWWFFIIWWFFIIWWFFIIWWFFIIWWFFIIWW.FIIWW...IW|
    stage 1 |.F....FF.IW.FFIIWWFFIIWWFFIIWWFFIIWWFFIIWWFFIIWWF.IIWW..IW.|
    stage 2 |..F..F..F.IFWIFWIFWIFWIFWIFWIFWIFWIFWIFWIFWIFWIFWIW.IW.IW..|
    stage 3 |...FF....FFIIWWFFIIWWFFIIWWFFIIWWFFIIWWFFIIWWFFIIWW..IIWW..|

    stage 0: F0 F1 F0.1 I0.1 W0.1 F2 F1.1 I1.1 I0 W1.1 W0 F3 F2.1 I2.1 I1 W2.1 W1 F4 F3.1 I3.1
             I2 W3.1 W2 F5 F4.1 I4.1 I3 W4.1 W3 F6 F5.1 I5.1 I4 W5.1 W4 F7 F6.1 I6.1 I5 W6.1 W5
             F7.1 I7.1 I6 W7.1 W6 I7 W7
    stage 1: F0 F0.1 F1 I0.1 W0.1 F1.1 F2 I0 I1.1 W1.1 W0 F2.1 F3 I1 I2.1 W2.1 W1 F3.1 F4 I2
             I3.1 W3.1 W2 F4.1 F5 I3 I4.1 W4.1 W3 F5.1 F6 I4 I5.1 W5.1 W4 F6.1 F7 I5 I6.1 W6.1
             W5 F7.1 I6 I7.1 W7.1 W6 I7 W7
    stage 2: F0 F0.1 F1 I0.1 F1.1 W0.1 I0 F2 W0 I1.1 F2.1 W1.1 I1 F3 W1 I2.1 F3.1 W2.1 I2 F4 W2
             I3.1 F4.1 W3.1 I3 F5 W3 I4.1 F5.1 W4.1 I4 F6 W4 I5.1 F6.1 W5.1 I5 F7 W5 I6.1 F7.1
             W6.1 I6 W6 I7.1 W7.1 I7 W7
    stage 3: F0 F0.1 F1 F1.1 I0.1 I0 W0.1 W0 F2 F2.1 I1.1 I1 W1.1 W1 F3 F3.1 I2.1 I2 W2.1 W2 F4
             F4.1 I3.1 I3 W3.1 W3 F5 F5.1 I4.1 I4 W4.1 W4 F6 F6.1 I5.1 I5 W5.1 W5 F7 F7.1 I6.1
             I6 W6.1 W6 I7.1 I7 W7.1 W7
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.ir import BackwardInput, BackwardWeight, Forward, Instruction
from schedcc.schedule import VShape

__all__ = ["VHalf", "VMin"]

#: The stable pattern's passes, in their column order: (class, chunk).
_PASSES = ((Forward, 0), (Forward, 1), (BackwardInput, 1), (BackwardInput, 0))
_PERIOD = 6  # F, F, I, I, W, W of one microbatch, one unit each


class _VShape(VShape):
    """Two chunks in a V, a stable pattern per stage (see the module docstring)."""

    def offsets(self, stage: int) -> tuple[int, int, int, int]:
        """When stage `stage` starts each pass of microbatch 0 (the stable pattern)."""
        raise NotImplementedError

    def steps(self, stage: int) -> Iterator[Instruction]:
        m = self.num_microbatches
        order = _order(self.offsets(stage), m)
        for batch in range(self.num_batches):
            first = batch * m
            for cls, chunk, microbatch in order:
                yield cls(first + microbatch, chunk=chunk)


class VHalf(_VShape):
    """V-Half: a V whose stages hold about half of 1F1B's activations."""

    name = "v-half"

    def offsets(self, stage: int) -> tuple[int, int, int, int]:
        p, s = self.num_stages, stage
        gap = 3 if p % 2 == 0 else 0
        return (2 * s, 3 * p - s - 2, 3 * p + gap + 2 * s - 1, 6 * p + gap - s - 2)


class VMin(_VShape):
    """V-Min: a V whose stages hold about a third of 1F1B's activations."""

    name = "v-min"

    def offsets(self, stage: int) -> tuple[int, int, int, int]:
        p, s = self.num_stages, stage
        gap = 2 if p % 3 == 0 else 0
        return (s, 2 * p - s - 1, 2 * p + gap + s, 4 * p + gap - s - 1)


def _order(offsets: tuple[int, ...], num_microbatches: int) -> list[tuple[type, int, int]]:
    """`(class, chunk, microbatch)` in time order of the stable pattern, each `W` in the first
    idle unit after its `I` (chunk 1's first), the rest at the end."""
    at = {offset + _PERIOD * i: (n, i) for n, offset in enumerate(offsets)
          for i in range(num_microbatches)}  # fmt: skip
    assert len(at) == len(offsets) * num_microbatches, "the pattern's passes collide"
    order: list[tuple[type, int, int]] = []
    pending: dict[int, list[int]] = {1: [], 0: []}  # chunk -> microbatches whose W waits
    for t in range(max(at) + 1):
        if t in at:
            n, i = at[t]
            cls, chunk = _PASSES[n]
            order.append((cls, chunk, i))
            if cls is BackwardInput:
                pending[chunk].append(i)
            continue
        for chunk in (1, 0):
            if pending[chunk]:
                order.append((BackwardWeight, chunk, pending[chunk].pop(0)))
                break
    for chunk in (1, 0):
        order.extend((BackwardWeight, chunk, i) for i in pending[chunk])
    return order
