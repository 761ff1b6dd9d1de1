"""ZB-V (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Section 6, the handcrafted V schedule).

Two chunks per stage, placed in a V: segment k < p lives on stage k as chunk 0 and segment
k >= p on stage 2p - 1 - k as chunk 1, so the forward runs down the stages and back up, and the
last segment (the loss) sits on stage 0 beside the first. The backward is split into
`BackwardInput` (I) and `BackwardWeight` (W). Stage s runs, for one batch:

1. warm-up: `2(p - s) - 1` chunk-0 forwards, then `s` pairs (chunk-1 F, chunk-0 F), then `p - s`
   triples (chunk-1 F, I, W) as the first gradients come back up the V;
2. steady state: (chunk-0 F, I, W), (chunk-1 F, I, W) until every forward is done;
3. cool-down: `s` pairs (chunk-0 I, chunk-1 I), `p - s` pairs (chunk-0 I, W), then the deferred W.

Properties (F = I = W = 1 per chunk, no comm cost, m >= 2p - 1): makespan 6m + p - 1, so the
idle time per stage is `p - 1` chunk-forwards, a sixth of 1F1B's on the same model; every stage
holds at most 2p chunk activations, what 1F1B's stage 0 holds (p microbatches of two chunks).
Any m >= 1 compiles and validates: for m < 2p - 1 the order is built for 2p - 1 microbatches and
the missing ones are dropped (valid, but the pipeline is not full, so the bubble grows).

p = 4, m = 8, compute order per stage (`.1` marks chunk 1):

    stage 0: F0 F1 F2 F3 F4 F5 F6 F0.1 I0.1 W0.1 F1.1 I1.1 W1.1 F2.1 I2.1 W2.1 F3.1 I3.1 W3.1 F7
             I0 W0 F4.1 I4.1 W4.1 I1 W1 F5.1 I5.1 W5.1 I2 W2 F6.1 I6.1 W6.1 I3 W3 F7.1 I7.1 W7.1
             I4 W4 I5 W5 I6 W6 I7 W7
    stage 1: F0 F1 F2 F3 F4 F0.1 F5 F1.1 I0.1 W0.1 F2.1 I1.1 W1.1 F3.1 I2.1 W2.1 F6 I0 W0 F4.1
             I3.1 W3.1 F7 I1 W1 F5.1 I4.1 W4.1 I2 W2 F6.1 I5.1 W5.1 I3 W3 F7.1 I6.1 W6.1 I4 I7.1
             I5 W4 I6 W5 I7 W6 W7.1 W7
    stage 2: F0 F1 F2 F0.1 F3 F1.1 F4 F2.1 I0.1 W0.1 F3.1 I1.1 W1.1 F5 I0 W0 F4.1 I2.1 W2.1 F6 I1
             W1 F5.1 I3.1 W3.1 F7 I2 W2 F6.1 I4.1 W4.1 I3 W3 F7.1 I5.1 W5.1 I4 I6.1 I5 I7.1 I6 W4
             I7 W5 W6.1 W7.1 W6 W7
    stage 3: F0 F0.1 F1 F1.1 F2 F2.1 F3 F3.1 I0.1 W0.1 F4 I0 W0 F4.1 I1.1 W1.1 F5 I1 W1 F5.1 I2.1
             W2.1 F6 I2 W2 F6.1 I3.1 W3.1 F7 I3 W3 F7.1 I4.1 W4.1 I4 I5.1 I5 I6.1 I6 I7.1 I7 W4
             W5.1 W6.1 W7.1 W5 W6 W7
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.ir import BackwardInput, BackwardWeight, Forward, Instruction
from schedcc.schedule import VShape

__all__ = ["ZBV"]

_KINDS = {"F": Forward, "I": BackwardInput, "W": BackwardWeight}


class ZBV(VShape):
    """ZB-V: two chunks per stage in a V, backward split in I and W; near-zero bubble."""

    name = "zb-v"

    def order(self, stage: int) -> Iterator[Instruction]:
        m = self.num_microbatches
        full = max(m, 2 * self.num_stages - 1)
        order = _v_order(self.num_stages, stage, full)
        for batch in range(self.num_batches):
            first = batch * m
            for kind, chunk, microbatch in order:
                if microbatch < m:
                    yield _KINDS[kind](first + microbatch, chunk=chunk)


class _Counter:
    """Hands out the next microbatch per (kind, chunk) and records the order."""

    def __init__(self) -> None:
        self.next = {(kind, chunk): 0 for kind in _KINDS for chunk in (0, 1)}
        self.order: list[tuple[str, int, int]] = []

    def put(self, kind: str, chunk: int) -> None:
        self.order.append((kind, chunk, self.next[kind, chunk]))
        self.next[kind, chunk] += 1


def _v_order(num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int, int]]:
    """Stage `stage`'s `(kind, chunk, microbatch)` order; needs `num_microbatches >= 2p - 1`."""
    p, s, n = num_stages, stage, num_microbatches
    at = _Counter()
    for _ in range(2 * (p - s) - 1):
        at.put("F", 0)
    for _ in range(s):
        at.put("F", 1)
        at.put("F", 0)
    for _ in range(p - s):
        for kind in "FIW":
            at.put(kind, 1)
    while at.next["F", 1] < at.next["F", 0] or at.next["F", 0] < n:
        if at.next["F", 0] < n:
            at.put("F", 0)
        at.put("I", 0)
        at.put("W", 0)
        for kind in "FIW":
            at.put(kind, 1)
    for _ in range(s):
        at.put("I", 0)
        at.put("I", 1)
    for _ in range(p - s):
        at.put("I", 0)
        at.put("W", 0)
    for chunk in (1, 0):
        while at.next["W", chunk] < n:
            at.put("W", chunk)
    return at.order
