"""Interleaved zero bubble, ZB1P with virtual stages (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism"; torch's `ScheduleInterleavedZeroBubble`).

Interleaved 1F1B's order with the backward split into `BackwardInput` (I) and `BackwardWeight`
(W), as ZB-H1 splits 1F1B's. Each stage holds `v` chunks, placed looped (segment k on stage
k % p, chunk k // p); the forwards run depth-first in interleaved 1F1B's groups (`max(1, m // p)`
of them), the I take the same sequence with the chunk reversed, and each W follows its I's
sequence. Stage s runs `(v - 1) * g + p - s - 1` warm-up forwards (`g` the largest group, capped
at `m * v`): one per hop to the last stage where interleaved 1F1B counts two, because an I
returns in one time unit where a full backward took two. Then one forward and one I at a time,
with the W starting `s` iterations late (ZB-H1's delay), so they fill the cool-down; the W left
over end the batch. Wherever torch accepts the shape (`m` a multiple of `max(1, m // p)`) the
order is torch's; with `v = 1` it is ZB-H1's.

Properties (F = I = W = 1 per chunk, no comm cost, `m` a multiple of `p`): makespan
`3 * v * m + p - 1`, so each stage idles `p - 1` units, ZB-H1's bubble against a pipeline v times
longer (ZB-V's makespan at v = 2); every stage holds at most `min(v * p, m * v)` chunk activations
between a forward and its W (what `simulate` counts; ZB-V: `2p`), stage s at most
`min(v * p - s, m * v)` between a forward and its I; one weight version. With other costs the W no
longer fit the gaps exactly (ZB-V and the paper's automatic schedules adapt to them).

p = 4, m = 8, v = 2, compute order per stage (`F3.1` is microbatch 3 on chunk 1; `schedcc show
--schedule interleaved-zb -p 4 -m 8`: makespan 51, peak activations per stage [8 8 8 8]):

    stage 0: F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 I0.1 W0.1 F4 I1.1 W1.1 F5 I2.1 W2.1 F6 I3.1 W3.1 F7
             I0 W0 F4.1 I1 W1 F5.1 I2 W2 F6.1 I3 W3 F7.1 I4.1 W4.1 I5.1 W5.1 I6.1 W6.1 I7.1 W7.1
             I4 W4 I5 W5 I6 W6 I7 W7
    stage 1: F0 F1 F2 F3 F0.1 F1.1 F2.1 I0.1 F3.1 I1.1 W0.1 F4 I2.1 W1.1 F5 I3.1 W2.1 F6 I0 W3.1
             F7 I1 W0 F4.1 I2 W1 F5.1 I3 W2 F6.1 I4.1 W3 F7.1 I5.1 W4.1 I6.1 W5.1 I7.1 W6.1 I4
             W7.1 I5 W4 I6 W5 I7 W6 W7
    stage 2: F0 F1 F2 F3 F0.1 F1.1 I0.1 F2.1 I1.1 F3.1 I2.1 W0.1 F4 I3.1 W1.1 F5 I0 W2.1 F6 I1
             W3.1 F7 I2 W0 F4.1 I3 W1 F5.1 I4.1 W2 F6.1 I5.1 W3 F7.1 I6.1 W4.1 I7.1 W5.1 I4 W6.1
             I5 W7.1 I6 W4 I7 W5 W6 W7
    stage 3: F0 F1 F2 F3 F0.1 I0.1 F1.1 I1.1 F2.1 I2.1 F3.1 I3.1 W0.1 F4 I0 W1.1 F5 I1 W2.1 F6
             I2 W3.1 F7 I3 W0 F4.1 I4.1 W1 F5.1 I5.1 W2 F6.1 I6.1 W3 F7.1 I7.1 W4.1 I4 W5.1 I5
             W6.1 I6 W7.1 I7 W4 W5 W6 W7
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from schedcc.ir import BackwardInput, BackwardWeight, Forward, Instruction
from schedcc.schedules.interleaved import Interleaved1F1B

__all__ = ["InterleavedZB", "zero_bubble_1f1b"]


def zero_bubble_1f1b(
    forwards: Sequence[Instruction],
    inputs: Sequence[Instruction],
    weights: Sequence[Instruction],
    warmup: int,
    delay: int,
) -> Iterator[Instruction]:
    """ZB-H1's interleaving of three equally long sequences: `warmup` forwards, then a forward
    (while any is left) and an input-backward at a time, each followed by a weight-backward once
    `delay` input-backwards have run without one; then the remaining weight-backwards.

    >>> ops = zero_bubble_1f1b("F0 F1".split(), "I0 I1".split(), "W0 W1".split(), 1, 1)
    >>> " ".join(ops)
    'F0 F1 I0 I1 W0 W1'
    """
    total = len(forwards)
    yield from forwards[:warmup]
    for k in range(total):
        if warmup + k < total:
            yield forwards[warmup + k]
        yield inputs[k]
        if k >= delay:
            yield weights[k - delay]
    yield from weights[max(0, total - delay) :]


class InterleavedZB(Interleaved1F1B):
    """Interleaved zero bubble (ZB1P): interleaved 1F1B with the backward split in I and W."""

    name = "interleaved-zb"

    default_num_chunks = 2

    def num_warmup(self, stage: int) -> int:
        """The forwards stage `stage` runs before its first I (torch's count)."""
        largest = max(len(group) for group in self.groups())
        warmup = (self.num_chunks - 1) * largest + self.num_stages - stage - 1
        return min(warmup, self.num_microbatches * self.num_chunks)

    def order(self, stage: int) -> Iterator[Instruction]:
        order, v, warmup = self.forward_order(), self.num_chunks, self.num_warmup(stage)
        for batch in range(self.num_batches):
            first = batch * self.num_microbatches
            forwards = [Forward(first + i, c) for i, c in order]
            inputs = [BackwardInput(first + i, v - 1 - c) for i, c in order]
            weights = [BackwardWeight(first + i, v - 1 - c) for i, c in order]
            yield from zero_bubble_1f1b(forwards, inputs, weights, warmup, stage)
