"""DualPipe (DeepSeek-V3 technical report, arXiv 2412.19437, Section 3.2.1; DeepSeek's
`dualpipe.py`): bidirectional pipeline parallelism, microbatches fed from both ends.

The model is cut into p segments and held twice (`num_replicas = 2`, see [Note: replicas] in
`schedcc.semantics.layout`): the first half of each batch's microbatches (replica 0) runs the model
down the stages, segment k on stage k as chunk 0; the second half (replica 1) enters at stage
p - 1 and runs it up, its segment p + j (a copy of segment j) on stage p - 1 - j as chunk 1. So
every stage holds two mirrored model segments, their parameters replicated and their gradients
summed before the step (`compile` ties each segment to its copy). Each half of the stages runs
DualPipeV's order (`dualpipe-v`) on m/2 microbatches per direction, stage s as DualPipeV's stage
`min(s, p - 1 - s)` of p/2, with its two directions swapped on the second half: warm-up
forwards, zero-bubble I/W, a steady state of forwards overlapped with the other direction's
backwards (`F3 +B1.1`), and a zero-bubble cool-down. Needs p even and m even with m >= 2p.

Properties (DeepSeek's table; PP = p, F&B an overlapped pair): bubble (p/2 - 1)(F&B + B - 3W),
2x parameters per device, activations for p + 1 chunk-microbatches per stage. Under
`CostModel()` (F = 1, B = 2, I = W = 1 for a whole segment, `overlap` 0.5): p = 4, m = 8 takes
24, against 26 for the same order without overlap and 33 for 1F1B; it holds 5 chunk
activations per stage (1F1B's stage 0: 4 microbatches of a whole segment).

p = 4, m = 8 (`COLUMNS=100 schedcc show --schedule dualpipe -p 4 -m 8 -v 2`; microbatches 0-3
run down, 4-7 up, `.1` marks chunk 1):

    stage 0 |F0 F1 F2 4.14.14.15.1F3 5.1 ....F +B0  B6.1  .F7.1+B1 B7.1  I2 W2 I3 W3 |
    stage 1 |...F0 4.1F1 5.1F2 B4.1  6.1+B0  F3+B5.17.1+B1 B6.1  B2    ..7.1I3 7.1W3 |
    stage 2 |...4.1F0 5.1F1 6.1B0    F2 +B4.1F +B1  F3 5.1 B2    B6.1  ..I3 7.1W3 7.1|
    stage 3 |4.15.16.1F0 I0 W0 F1 7.1+B1 ....F2+B4.1B2    .F3  5.1 B3    6.16.17.17.1|

and the compute order per stage:

    stage 0: F0 F1 F2 F4.1 I4.1 W4.1 F5.1 F3 +B5.1 F6.1 +B0 B6.1 F7.1 +B1 B7.1 I2 W2 I3 W3
    stage 1: F0 F4.1 F1 F5.1 F2 B4.1 F6.1 +B0 F3 +B5.1 F7.1 +B1 B6.1 B2 I7.1 I3 W7.1 W3
    stage 2: F4.1 F0 F5.1 F1 F6.1 B0 F2 +B4.1 F7.1 +B1 F3 +B5.1 B2 B6.1 I3 I7.1 W3 W7.1
    stage 3: F4.1 F5.1 F6.1 F0 I0 W0 F1 F7.1 +B1 F2 +B4.1 B2 F3 +B5.1 B3 I6.1 W6.1 I7.1 W7.1
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.errors import ScheduleConfigError
from schedcc.ir import Instruction
from schedcc.schedule import VShape
from schedcc.schedules.dualpipe_v import _KINDS, _order

__all__ = ["DualPipe"]


class DualPipe(VShape):
    """DualPipe: two model replicas, microbatches entering at both ends, overlapped F&B."""

    name = "dualpipe"
    num_replicas = 2

    def check(self) -> None:
        super().check()
        p, m = self.num_stages, self.num_microbatches
        if p % 2 or m % 2 or m < 2 * p:
            raise ScheduleConfigError(
                f"dualpipe needs an even p and an even m >= 2p (half the microbatches from each "
                f"end), got p={p}, m={m}; use dualpipe-v for other shapes"
            )

    def replica_of(self, microbatch: int) -> int:
        """The first half of a batch's microbatches runs down the stages, the second up."""
        return int(microbatch >= self.num_microbatches // 2)

    def order(self, stage: int) -> Iterator[Instruction]:
        p, m = self.num_stages, self.num_microbatches
        flip = int(stage >= p // 2)  # the second half runs its directions the other way
        order = _order(p // 2, min(stage, p - 1 - stage), m // 2)
        for batch in range(self.num_batches):
            first = batch * m
            for kind, chunk, microbatch in order:
                chunk ^= flip
                yield _KINDS[kind](first + chunk * (m // 2) + microbatch, chunk=chunk)
