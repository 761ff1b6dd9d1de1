"""ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Section 2.1, Figure 3 top).

The backward is split into `BackwardInput` (I: the gradient for the stage's input, on the critical
path) and `BackwardWeight` (W: the gradient for its weights, needed only by the optimizer step).
Stage s runs 1F1B's `p - s - 1` warm-up forwards, then one forward and one input-backward at a
time; its weight-backwards start `s` iterations late, so every stage keeps the same number of
microbatches in flight (forwarded, weight gradient not yet taken), and the deferred W fill the
cool-down that 1F1B leaves idle. A microbatch's activations are held until its W (the weight
gradient needs the saved inputs), so every stage peaks at `min(p, m)`: 1F1B's stage-0 peak.

Properties (no comm cost, m >= p, W <= min(F, I)): makespan `m(F + I + W) + (p - 1)(F + I - W)`,
the paper's ZB-H1 bubble `(p - 1)(F + I - W)`; with F = I = W = 1 that is 3m + p - 1, a bubble a
third of 1F1B's `(p - 1)(F + I + W)`. A W longer than F or I no longer fits the gaps it fills.

p = 4, m = 8, compute order per stage:

    stage 0: F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7
    stage 1: F0 F1 F2 I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7
    stage 2: F0 F1 I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7
    stage 3: F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7

(the order of the paper's Figure 3, top, read per stage: 1-based there, 0-based here).
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.ir import BackwardInput, BackwardWeight, Forward, Instruction
from schedcc.schedule import Schedule

__all__ = ["ZBH1"]


class ZBH1(Schedule):
    """ZB-H1: 1F1B with the backward split in I and W, W deferred into the cool-down bubble."""

    name = "zb-h1"

    def order(self, stage: int) -> Iterator[Instruction]:
        for batch in range(self.num_batches):
            first = batch * self.num_microbatches
            for kind, microbatch in _h1_order(self.num_stages, self.num_microbatches, stage):
                yield kind(first + microbatch)


def _h1_order(num_stages: int, num_microbatches: int, stage: int):
    """Stage `stage`'s `(instruction class, microbatch)` order for one batch."""
    m = num_microbatches
    warmup = min(num_stages - stage - 1, m)
    delay = stage  # steady iterations that run without a W
    order: list[tuple[type[Instruction], int]] = [(Forward, i) for i in range(warmup)]
    weights = 0
    for j in range(m):
        if warmup + j < m:
            order.append((Forward, warmup + j))
        order.append((BackwardInput, j))
        if j >= delay:
            order.append((BackwardWeight, weights))
            weights += 1
    order.extend((BackwardWeight, i) for i in range(weights, m))
    return order
