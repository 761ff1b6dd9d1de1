"""ZB-H2 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Section 2.2, Figure 3 bottom).

The backward is split into `BackwardInput` (I) and `BackwardWeight` (W), as in ZB-H1. ZB-H2
trades memory for the last of ZB-H1's bubble: stage s runs `2(p - s) - 1` warm-up forwards (every
forward that fits before its first I can arrive, where ZB-H1 runs `p - s - 1`), then after each
I one forward, preceded by a W whenever `2p - 1` microbatches are in flight (forwarded, W not yet
run); once its forwards are done, one W after each I, and the W left over at the end. Each
stage's W move into its tail: stage s ends with `2s + 1` of them. Each stage then works without
a gap from its first forward to its last W, so the per-batch timeline is a parallelogram, not
ZB-H1's trapezoid, and consecutive batches (`num_batches > 1`; every stage steps its own
optimizer, there is no cross-stage flush) fit together with no bubble between them.

Properties (no comm cost, m >= 2p - 1, W <= F <= I): one batch takes
`m(F + I + W) + (p - 1) max(F, F + I - 2W)`, and each further batch adds
`m(F + I + W) + (p - 1)(F + I - 2W)`: the paper's ZB-H2 bubble `(p - 1)(F + I - 2W)`, zero at
F = I = W. With F = I = W = 1, B batches take `3mB + p - 1` (ZB-H1: `B(3m + p - 1)`), the
start-up paid once per program; one batch alone takes ZB-H1's `3m + p - 1`, which no order
beats (the last stage cannot start before `p - 1`). Memory, about twice ZB-H1's: every stage
holds at most `min(2p - 1, m)` microbatches between a forward and its W, what `simulate` counts
(ZB-H1: `min(p, m)`), and stage s at most `min(2(p - s) - 1, m)` between a forward and its I
(ZB-H1: `min(p - s, m)`); one weight version.

p = 4, m = 8, compute order per stage (`schedcc show --schedule zb-h2 -p 4 -m 8`):

    stage 0 |F0 F1 F2 F3 F4 F5 F6 I0 W0 F7 I1 W1 I2 W2 I3 W3 I4 W4 I5 W5 I6 W6 I7 W7 .........|
    stage 1 |...F0 F1 F2 F3 F4 I0 F5 I1 F6 I2 W0 F7 I3 W1 I4 W2 I5 W3 I6 W4 I7 W5 W6 W7 ......|
    stage 2 |......F0 F1 F2 I0 F3 I1 F4 I2 F5 I3 F6 I4 W0 F7 I5 W1 I6 W2 I7 W3 W4 W5 W6 W7 ...|
    stage 3 |.........F0 I0 F1 I1 F2 I2 F3 I3 F4 I4 F5 I5 F6 I6 W0 F7 I7 W1 W2 W3 W4 W5 W6 W7 |
    makespan 27, bubble 11.1%, peak activations per stage [7 7 7 7], peak weight versions 1

(compare the paper's Figure 3, bottom, numbered from 1). Any m >= 1 is valid; below `2p - 1`
the warm-up is capped at m and the pipeline never fills.
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.ir import BackwardInput, BackwardWeight, Forward, Instruction
from schedcc.schedule import Schedule

__all__ = ["ZBH2"]


class ZBH2(Schedule):
    """ZB-H2: ZB-H1 with 2(p - s) - 1 warm-up forwards and W moved into the tail; no bubble."""

    name = "zb-h2"

    def order(self, stage: int) -> Iterator[Instruction]:
        order = _h2_order(self.num_stages, self.num_microbatches, stage)
        for batch in range(self.num_batches):
            first = batch * self.num_microbatches
            for kind, microbatch in order:
                yield kind(first + microbatch)


def _h2_order(num_stages: int, num_microbatches: int, stage: int):
    """Stage `stage`'s `(instruction class, microbatch)` order for one batch."""
    m, in_flight = num_microbatches, 2 * num_stages - 1
    done = {Forward: 0, BackwardInput: 0, BackwardWeight: 0}
    order: list[tuple[type[Instruction], int]] = []

    def run(kind: type[Instruction]) -> None:
        order.append((kind, done[kind]))
        done[kind] += 1

    for _ in range(min(2 * (num_stages - stage) - 1, m)):
        run(Forward)
    for _ in range(m):
        run(BackwardInput)
        if done[Forward] == m:
            run(BackwardWeight)
            continue
        if done[Forward] - done[BackwardWeight] >= in_flight:
            run(BackwardWeight)
        run(Forward)
    while done[BackwardWeight] < m:
        run(BackwardWeight)
    return order
