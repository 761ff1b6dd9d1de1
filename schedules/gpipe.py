"""GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism"): every forward of the batch, then every backward in reverse order, then a flush.

Properties (F = 1, B = 2, no comm cost): makespan 3(m + p - 1), bubble (p - 1) / (m + p - 1);
every stage holds all m microbatch activations at its peak; one weight version.

p = 4, m = 4 (time runs right, one column per unit; a backward takes two):

    stage 0: F0 F1 F2 F3 .  .  .  .  .  .  .  .  .  B3 B3 B2 B2 B1 B1 B0 B0
    stage 1: .  F0 F1 F2 F3 .  .  .  .  .  .  B3 B3 B2 B2 B1 B1 B0 B0 .  .
    stage 2: .  .  F0 F1 F2 F3 .  .  .  B3 B3 B2 B2 B1 B1 B0 B0 .  .  .  .
    stage 3: .  .  .  F0 F1 F2 F3 B3 B3 B2 B2 B1 B1 B0 B0 .  .  .  .  .  .

With `v > 1` chunks (looped placement) it forwards every microbatch through chunk 0, then chunk 1,
..., and backwards in the exact reverse order; every stage then holds all `m * v` chunk
activations at its peak.
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.ir import Backward, Forward, Instruction
from schedcc.schedule import Schedule

__all__ = ["GPipe"]


class GPipe(Schedule):
    """GPipe: all forwards, then all backwards in reverse order (a flush per batch)."""

    name = "gpipe"
    chunks = "any"

    def order(self, stage: int) -> Iterator[Instruction]:
        for batch in range(self.num_batches):
            microbatches = self.microbatches(batch)
            for chunk in range(self.num_chunks):
                for i in microbatches:
                    yield Forward(i, chunk)
            for chunk in reversed(range(self.num_chunks)):
                for i in reversed(microbatches):
                    yield Backward(i, chunk)
