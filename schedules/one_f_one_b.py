"""1F1B, also PipeDream-Flush (Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", Figure 4 top; DeepSpeed's TrainSchedule).

Stage s runs `min(p - s - 1, m)` warm-up forwards, then alternates one forward and one backward,
then drains the remaining backwards; a flush ends each batch. This is exactly the per-stage order
of Megatron-LM's `forward_backward_pipelining_without_interleaving`. It works for m < p too.

Properties (F = 1, B = 2, no comm cost): makespan 3(m + p - 1) and bubble (p - 1) / (m + p - 1),
as GPipe, but stage s holds at most `min(p - s, m)` microbatch activations instead of m; one
weight version.

p = 4, m = 8, compute order per stage:

    stage 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7
    stage 1: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7
    stage 2: F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7
    stage 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from schedcc.ir import Backward, Forward, Instruction
from schedcc.schedule import Schedule

__all__ = ["OneFOneB", "one_f_one_b"]


def one_f_one_b(
    forwards: Sequence[Instruction], backwards: Sequence[Instruction], warmup: int
) -> Iterator[Instruction]:
    """The 1F1B interleaving of two equally long sequences: `warmup` forwards, then one forward
    one backward, then the remaining backwards. Shared by 1F1B, 2BW and interleaved 1F1B.

    >>> [str(op) for op in one_f_one_b([Forward(0), Forward(1)], [Backward(0), Backward(1)], 1)]
    ['F0', 'F1', 'B0', 'B1']
    """
    total = len(forwards)
    yield from forwards[:warmup]
    for k in range(total - warmup):
        yield forwards[warmup + k]
        yield backwards[k]
    yield from backwards[total - warmup :]


class OneFOneB(Schedule):
    """1F1B (PipeDream-Flush): warm-up forwards, then one forward one backward, then drain."""

    name = "1f1b"

    def order(self, stage: int) -> Iterator[Instruction]:
        warmup = min(self.num_stages - stage - 1, self.num_microbatches)
        for batch in range(self.num_batches):
            microbatches = self.microbatches(batch)
            forwards = [Forward(i) for i in microbatches]
            backwards = [Backward(i) for i in microbatches]
            yield from one_f_one_b(forwards, backwards, warmup)
