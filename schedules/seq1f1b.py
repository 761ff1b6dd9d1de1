"""Seq1F1B (Sun et al. 2024, "Seq1F1B: Efficient Sequence-Level Pipeline Parallelism for Large
Language Model Training", NAACL 2025): 1F1B over the sequence parts of each microbatch.

Each microbatch of the data is split along the sequence into `k = num_parts` parts (a part is a
microbatch index of its own: [Note: sequence parts] in `schedcc.rules.parts`). Part `j + 1`'s
forward consumes part `j`'s carry (attention's keys and values) on every segment, so a
microbatch's parts go forward in order and backward in reverse. Stage s runs the 1F1B pattern over
the parts with `k - 1` more warm-up forwards than 1F1B (`p - s - 1 + k - 1`): its first backward
is the last part of microbatch 0, which needs every part of it forwarded. Stage s then holds at
most `p - s - 1 + k` part activations, each `1/k` of a microbatch's: about `1/k` of 1F1B's peak
for the same microbatches when `p` is large, with a bubble of about `(p - 1)/k` microbatch
forwards-and-backwards instead of `p - 1`.

p = 2, m = 4 microbatch indices (2 microbatches of the data, k = 2 parts each: F0 F1 are the
two parts of data microbatch 0), compute order per stage:

    stage 0: F0 F1 F2 B1 F3 B0 B3 B2
    stage 1: F0 F1 B1 F2 B0 F3 B3 B2
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

from schedcc.ir import Backward, Forward, Instruction
from schedcc.schedule import Schedule
from schedcc.schedules.one_f_one_b import one_f_one_b

__all__ = ["Seq1F1B"]


class Seq1F1B(Schedule):
    """Seq1F1B: 1F1B over sequence parts, each microbatch's parts backward in reverse."""

    name = "seq1f1b"
    chunks: ClassVar[tuple[int, ...]] = (1,)
    default_num_parts = 2

    def order(self, stage: int) -> Iterator[Instruction]:
        k, m = self.num_parts, self.num_microbatches
        warmup = min(self.num_stages - stage - 1 + k - 1, m)
        for batch in range(self.num_batches):
            microbatches = self.microbatches(batch)
            forwards = [Forward(i) for i in microbatches]
            # each microbatch of the data's parts in reverse: k - 1 first
            backwards = [Backward(i) for i in _reversed_parts(microbatches, k)]
            yield from one_f_one_b(forwards, backwards, warmup)


def _reversed_parts(microbatches: range, num_parts: int) -> list[int]:
    """`microbatches` with each run of `num_parts` reversed: [0, 1, 2, 3] -> [1, 0, 3, 2].

    >>> _reversed_parts(range(4, 10), 3)
    [6, 5, 4, 9, 8, 7]
    """
    out: list[int] = []
    for start in range(microbatches.start, microbatches.stop, num_parts):
        out.extend(range(start + num_parts - 1, start - 1, -1))
    return out
