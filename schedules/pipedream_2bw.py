"""PipeDream-2BW (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training",
Figure 2): 1F1B with double-buffered weights and no flush.

The 1F1B steady state runs across batch boundaries: the warm-up happens once at the start of the
program and the drain once at its end, and the forwards of batch b + 1 interleave with the
backwards of batch b. Stage s runs `min(p - s - 1, B * m)` warm-up forwards over the global
microbatch sequence, then one forward one backward, then drains. `weight_delay = 1`: the forwards
of batch b use weight version `max(0, b - 1)` and each backward uses the version its forward used
(weight stashing), so `W[b + 1] = W[b] - lr * grad(loss_b at W[b - 1])`. The compiler puts each
batch's `OptimizerStep` after its last backward on each stage.

Rules: one chunk per stage (`num_chunks == 1`); with three or more batches, `m >= p - 1`.
Otherwise stage 0's warm-up runs a forward of batch b + 2 (version b + 1) before batch b's
backwards (version b - 1) are done, so three versions would have to live at once; the validator
reports it as a `WeightVersionError`. With one or two batches every forward uses version 0.

Properties (F = 1, B = 2, no comm cost): makespan `3 * (B * m + p - 1)`, so the bubble fraction
`(p - 1) / (B * m + p - 1)` is paid once per program instead of once per batch; stage s holds at
most `min(p - s, B * m)` microbatch activations; at most two weight versions per stage (the
current one and the one stashed for in-flight backwards).

p = 4, m = 4, two batches (microbatches 4..7 are batch 1), compute order per stage:

    stage 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7
    stage 1: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7
    stage 2: F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7
    stage 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7

(each stage steps after B3 and after B7; F4..F7 use version 0, the next batch's forwards version 1)
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.errors import ScheduleConfigError
from schedcc.ir import Backward, Forward, Instruction
from schedcc.schedule import Schedule
from schedcc.schedules.one_f_one_b import one_f_one_b

__all__ = ["PipeDream2BW"]


class PipeDream2BW(Schedule):
    """PipeDream-2BW: 1F1B across batches with no flush, two weight versions (weight stashing)."""

    name = "2bw"
    weight_delay = 1

    def check(self) -> None:
        p, m = self.num_stages, self.num_microbatches
        if self.num_batches >= 3 and m < p - 1:
            raise ScheduleConfigError(
                f"2bw needs num_microbatches >= num_stages - 1 when num_batches >= 3 (got "
                f"num_microbatches={m}, num_stages={p}): otherwise stage 0 would forward batch "
                "b + 2 before batch b's optimizer step, needing a third weight version; raise "
                "num_microbatches or use num_batches <= 2"
            )

    def num_warmup(self, stage: int) -> int:
        """The forwards stage `stage` runs before its first backward, over the whole program."""
        return min(self.num_stages - stage - 1, self.num_microbatches_total)

    def order(self, stage: int) -> Iterator[Instruction]:
        microbatches = range(self.num_microbatches_total)
        forwards = [Forward(i) for i in microbatches]
        backwards = [Backward(i) for i in microbatches]
        yield from one_f_one_b(forwards, backwards, self.num_warmup(stage))
