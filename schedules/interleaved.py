"""Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", Figure 4 bottom; Megatron-LM's
`forward_backward_pipelining_with_interleaving`).

Each stage holds `v` chunks, placed looped (segment k on stage k % p, chunk k // p). The forwards
of a batch run depth-first in groups of microbatches: a group's microbatches through chunk 0, then
through chunk 1, ..., then the next group. The backwards run the same sequence with the chunk
reversed (`v - 1 - c`), each chunk taking its microbatches in order. Stage s runs
`(p - s - 1) * 2 + (v - 1) * g` warm-up forwards (`g` the largest group, capped at the `m * v`
computes of the batch), then one forward one backward, then drains; a flush ends each batch.

Groups: `max(1, m // p)` of them, as equal as possible (the larger first), as in torch's
`ScheduleInterleaved1F1B`; for `m` a multiple of `p` that is groups of `p`, as in Megatron-LM.

Where Megatron-LM accepts the shape (`m` a multiple of `p`, `v >= 2`), each stage's compute
order is exactly current Megatron-LM's (`get_schedule_table` with
`microbatch_group_size_per_vp_stage = p`), and wherever torch accepts the shape it is torch's.
At `m == p` that means no special case: classic Megatron-LM ran all forwards first there, while
Megatron-LM today and torch use the same warm-up count as for `m > p`, so the later stages start
1F1B earlier and hold fewer activations, at the same makespan `3 * (v * m + p - 1)`. The shapes
they reject are decided as follows; each validates (checked for p <= 8, m <= 32, v <= 4 by the
tests):

- `m < p` (Megatron-LM rejects): supported, one group of `m`, as torch does.
- `m % p != 0`, `m > p` (Megatron-LM rejects; torch too unless the groups come out equal):
  supported with groups differing by one and the warm-up counted with the largest; a smaller
  warm-up would make a backward wait for a forward its own stage runs later.
- `p == 2` (old Megatron-LM rejects) and `p == 1`: supported.
- `v == 1`: exactly the 1F1B order (nothing to interleave).

Properties (F = 1, B = 2 per chunk, no comm cost, `m` a multiple of `p`): bubble fraction about
`(p - 1) / (v * m + p - 1)`, the 1F1B bubble shrunk by about `v` (p = 4, m = 8, v = 2 takes
exactly the formula's 57 time units), except at p = 2 under rendezvous exchanges (see [Note:
interleaved at two stages]);
stage s holds at most its warm-up + 1 chunk activations (microbatch x chunk), capped at `m * v`:
`min((p - s - 1) * 2 + (v - 1) * p + 1, m * v)` for `m >= p`, against v times fewer, larger
ones in 1F1B; one weight version.

p = 4, m = 8, v = 2, compute order per stage (`F3.1` is microbatch 3 on chunk 1):

    stage 0: F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 F4 F5 F6 B0.1 F7 B1.1 F4.1 B2.1 F5.1 B3.1 F6.1 B0 ...
    stage 1: F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 F4 B0.1 F5 B1.1 F6 B2.1 F7 B3.1 F4.1 B0 F5.1 B1 ...
    stage 2: F0 F1 F2 F3 F0.1 F1.1 F2.1 B0.1 F3.1 B1.1 F4 B2.1 F5 B3.1 F6 B0 F7 B1 F4.1 B2 ...
    stage 3: F0 F1 F2 F3 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 F4 B0 F5 B1 F6 B2 F7 B3 ...

[Note: interleaved at two stages] At p = 2, with every exchange a rendezvous (the rendezvous model
the validator proves and `simulate` times by default, and Megatron-LM's own blocking
`send_forward_recv_backward`), Megatron-LM's order (torch's too) idles beyond the ideal makespan
`(F + B) * (v * m + p - 1)` once m is a multiple of p above p (v = 2, m = 8: 57 time units against
51 at F = 1, B = 2). The idling is the rendezvous's, not the order's: with sends that never wait
(`simulate(..., eager=True)`, how the distributed engine runs over gloo and torch posts its sends)
the same order takes exactly the ideal (tested). One warm-up forward fewer on stage 0, or groups of
four microbatches, also reach the ideal under rendezvous, but gain nothing eagerly that outweighs
their cost (docs/performance.md); the built-in keeps Megatron-LM's and torch's groups of p.
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.ir import Backward, Forward, Instruction
from schedcc.schedule import Schedule
from schedcc.schedules.one_f_one_b import one_f_one_b

__all__ = ["Interleaved1F1B"]


class Interleaved1F1B(Schedule):
    """Interleaved 1F1B (Megatron-LM virtual stages): v looped chunks per stage, depth-first."""

    name = "interleaved-1f1b"
    chunks = "any"

    def groups(self) -> list[range]:
        """The microbatch groups of batch 0 that run depth-first through the chunks.

        `max(1, m // p)` groups whose sizes differ by at most one, the larger first.

        >>> Interleaved1F1B(4, 10, 2).groups()
        [range(0, 5), range(5, 10)]
        """
        p, m = self.num_stages, self.num_microbatches
        num_groups = max(1, m // p)
        size, num_larger = divmod(m, num_groups)
        groups, start = [], 0
        for g in range(num_groups):
            stop = start + size + (g < num_larger)
            groups.append(range(start, stop))
            start = stop
        return groups

    def forward_order(self) -> list[tuple[int, int]]:
        """The `(microbatch, chunk)` sequence every stage forwards in, for batch 0."""
        return [(i, c) for group in self.groups() for c in range(self.num_chunks) for i in group]

    def num_warmup(self, stage: int) -> int:
        """The forwards stage `stage` runs before its first backward (Megatron-LM's count)."""
        p, m, v = self.num_stages, self.num_microbatches, self.num_chunks
        total = m * v
        if v == 1:
            return min(p - stage - 1, m)  # plain 1F1B
        largest = max(len(group) for group in self.groups())
        return min((p - stage - 1) * 2 + (v - 1) * largest, total)

    def order(self, stage: int) -> Iterator[Instruction]:
        order, v, warmup = self.forward_order(), self.num_chunks, self.num_warmup(stage)
        for batch in range(self.num_batches):
            first = batch * self.num_microbatches
            forwards = [Forward(first + i, c) for i, c in order]
            backwards = [Backward(first + i, v - 1 - c) for i, c in order]
            yield from one_f_one_b(forwards, backwards, warmup)
