"""DualPipeV (DeepSeek's `dualpipev`, the V-folded DualPipe of the DeepSeek-V3 report,
arXiv 2412.19437, "cut in half" by Sea AI Lab; torch's `ScheduleDualPipeV`).

Two chunks per stage in a V, as in zb-v: segment k < p on stage k as chunk 0, segment
k >= p on stage 2p - 1 - k as chunk 1, so the loss sits on stage 0. In the steady state every
forward is overlapped with a backward of the other chunk (`F3 +B1.1`, see [Note: overlapped
pairs] in `schedcc.rules.overlap`), which hides the communication of one behind the computation
of the other. Stage s runs, for one batch of m >= 2p microbatches (the order of DeepSeek's
`dualpipev.py` and torch's, step for step):

1. `2(p - s - 1)` chunk-0 forwards, then `s + 1` pairs (chunk-0 F, chunk-1 F);
2. `p - s - 1` times chunk-1 I, W, F (zero-bubble warm-up);
3. steady state, `m - 2p + s + 1` times: chunk-0 F overlapped with a chunk-1 backward, then
   chunk-1 F overlapped with a chunk-0 backward (on stage p - 1 the very first of these runs
   plain, F then B, to start the turn of the V earlier);
4. `p - s - 1` times: chunk-1 B, then chunk-1 F overlapped with a chunk-0 backward;
5. cool-down: `s + 1` pairs of backwards (chunk 1, chunk 0), switching from B to I at the middle,
   then `p - s - 1` times W and a chunk-0 backward, then the last W's.

Properties (DeepSeek's table; PP = 2p segments, F&B the time of an overlapped pair): bubble
(p - 1)(F&B + B - 3W) per stage, 2x parameters per device (two chunks), activations for
2p + 1 chunk-microbatches on stage 0 (PP + 1; zb-v's 2p plus one). Under `CostModel()` (F = 1,
B = 2, I = W = 1, `overlap` = 0.5, so F&B = 2.5): p = 4, m = 8 takes 49 against 54 for the same
order with no overlap (`CostModel(overlap=1)`), and 1F1B on the same model (F = 2, B = 4 per
stage) 66.

p = 4, m = 8 (`COLUMNS=100 schedcc show --schedule dualpipe-v -p 4 -m 8 -v 2`, one time unit
per column; a pair's `+B` block follows its `F`):

    stage 0 |FFFFFFFFIWFIWFIWFF+B.F+BB F +B F+BB F +B IWIWIWIW|
    stage 1 |.FFFFFFFFIWFIWFF+B.F+B+BF+B .F+BB F+B B4.IIWIWIWW|
    stage 2 |..FFFFFFFFIWFF+BF +F+B+BF+F +B F+BB B4B I5IIWIWWW|
    stage 3 |...FFFFFFFFFB F+F5+F+B+BF+F7+F+BB B4B B5I .IIWWWW|

and the compute order per stage (`.1` marks chunk 1, `+B` a backward overlapped with the
forward before it):

    stage 0: F0 F1 F2 F3 F4 F5 F6 F0.1 I0.1 W0.1 F1.1 I1.1 W1.1 F2.1 I2.1 W2.1 F3.1 F7 +B3.1
             F4.1 +B0 B4.1 F5.1 +B1 B5.1 F6.1 +B2 B6.1 F7.1 +B3 B7.1 I4 W4 I5 W5 I6 W6 I7 W7
    stage 1: F0 F1 F2 F3 F4 F0.1 F5 F1.1 I0.1 W0.1 F2.1 I1.1 W1.1 F3.1 F6 +B2.1 F4.1 +B0 F7
             +B3.1 F5.1 +B1 B4.1 F6.1 +B2 B5.1 F7.1 +B3 B6.1 B4 I7.1 I5 W7.1 I6 W5 I7 W6 W7
    stage 2: F0 F1 F2 F0.1 F3 F1.1 F4 F2.1 I0.1 W0.1 F3.1 F5 +B1.1 F4.1 +B0 F6 +B2.1 F5.1 +B1 F7
             +B3.1 F6.1 +B2 B4.1 F7.1 +B3 B5.1 B4 B6.1 I5 I7.1 I6 W5 I7 W7.1 W6 W7
    stage 3: F0 F0.1 F1 F1.1 F2 F2.1 F3 F3.1 F4 B0.1 F4.1 +B0 F5 +B1.1 F5.1 +B1 F6 +B2.1 F6.1
             +B2 F7 +B3.1 F7.1 +B3 B4.1 B4 B5.1 B5 I6.1 I6 I7.1 I7 W6.1 W6 W7.1 W7
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.errors import ScheduleConfigError
from schedcc.ir import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    OverlappedBackward,
)
from schedcc.schedule import VShape

__all__ = ["DualPipeV"]

_KINDS = {
    "F": Forward,
    "B": Backward,
    "+B": OverlappedBackward,
    "I": BackwardInput,
    "W": BackwardWeight,
}


class DualPipeV(VShape):
    """DualPipeV: zb-v's V placement with each steady-state forward overlapped with a backward."""

    name = "dualpipe-v"

    def check(self) -> None:
        super().check()
        if self.num_microbatches < 2 * self.num_stages:
            raise ScheduleConfigError(
                f"dualpipe-v needs at least 2p = {2 * self.num_stages} microbatches (one per "
                f"segment), got m={self.num_microbatches}; raise m or use zb-v"
            )

    def order(self, stage: int) -> Iterator[Instruction]:
        m = self.num_microbatches
        order = _order(self.num_stages, stage, m)
        for batch in range(self.num_batches):
            first = batch * m
            for kind, chunk, microbatch in order:
                yield _KINDS[kind](first + microbatch, chunk=chunk)


class _Counter:
    """Hands out the next microbatch per (forward or backward, chunk) and records the order; a
    `BackwardInput` queues its `BackwardWeight`, which `weight()` puts, oldest first."""

    def __init__(self) -> None:
        self.next = {(kind, chunk): 0 for kind in "FB" for chunk in (0, 1)}
        self.weights: list[tuple[int, int]] = []
        self.order: list[tuple[str, int, int]] = []

    def put(self, kind: str, chunk: int) -> None:
        key = ("F" if kind == "F" else "B", chunk)
        microbatch = self.next[key]
        self.next[key] += 1
        self.order.append((kind, chunk, microbatch))
        if kind == "I":
            self.weights.append((chunk, microbatch))

    def weight(self) -> None:
        if self.weights:
            chunk, microbatch = self.weights.pop(0)
            self.order.append(("W", chunk, microbatch))


def _order(num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int, int]]:
    """Stage `stage`'s `(kind, chunk, microbatch)` order; needs `num_microbatches >= 2p`."""
    p, s, n = num_stages, stage, num_microbatches
    at = _Counter()
    for _ in range(2 * (p - s - 1)):
        at.put("F", 0)
    for _ in range(s + 1):
        at.put("F", 0)
        at.put("F", 1)
    for _ in range(p - s - 1):
        at.put("I", 1)
        at.weight()
        at.put("F", 1)
    for i in range(n - 2 * p + s + 1):
        at.put("F", 0)
        at.put("B" if i == 0 and s == p - 1 else "+B", 1)
        at.put("F", 1)
        at.put("+B", 0)
    for _ in range(p - s - 1):
        at.put("B", 1)
        at.put("F", 1)
        at.put("+B", 0)
    split = False  # the second half of the cool-down splits its backwards (zero bubble)
    for i in range(s + 1):
        split = split or (i == (s + 1) // 2 and s % 2 == 1)
        at.put("I" if split else "B", 1)
        split = split or (i == (s + 1) // 2 and s % 2 == 0)
        at.put("I" if split else "B", 0)
    for _ in range(p - s - 1):
        at.weight()
        at.put("I" if split else "B", 0)
    while at.weights:
        at.weight()
    return at.order
