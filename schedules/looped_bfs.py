"""Looped breadth-first pipeline parallelism (Lamy-Poirier 2023, "Breadth-First Pipeline
Parallelism"; torch's `ScheduleLoopedBFS`).

Each stage holds `v` chunks, placed looped (segment k on stage k % p, chunk k // p). Every
microbatch runs forward through chunk 0, then every microbatch through chunk 1, ..., and the
backwards run in the exact reverse order: the last chunk first, its microbatches last-in
first-out. It is GPipe over the `p * v` looped segments (`gpipe -v V` yields the same order);
the name is torch's. Breadth-first finishes each chunk's backwards in one run, so that chunk's
data-parallel gradient reduction (a reduce-scatter under ZeRO) overlaps the rest of the drain;
depth-first schedules (interleaved 1F1B) hold fewer activations instead.

Properties (F = 1, B = 2 per chunk, no comm cost, m >= p): makespan `3(v * m + p - 1)`, bubble
`(p - 1) / (v * m + p - 1)`, interleaved 1F1B's; every stage holds all `m * v` chunk
activations at its peak (GPipe's memory); one weight version. With `m < p` each chunk waits
for the previous one to come round and the bubble grows.

p = 4, m = 4, v = 2, compute order per stage (`.1` marks chunk 1; `schedcc show --schedule
looped-bfs -p 4 -m 4`: makespan 33, peak activations per stage [8 8 8 8]):

    stage 0: F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 B3.1 B2.1 B1.1 B0.1 B3 B2 B1 B0
    stage 1: F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 B3.1 B2.1 B1.1 B0.1 B3 B2 B1 B0
    stage 2: F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 B3.1 B2.1 B1.1 B0.1 B3 B2 B1 B0
    stage 3: F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 B3.1 B2.1 B1.1 B0.1 B3 B2 B1 B0

(the same order on every stage; the timeline's shape comes from the waits: stage s starts at
time s, chunk 1 of microbatch 0 needs it to come round the loop from stage p - 1, and the
backwards start on stage p - 1).
"""

from __future__ import annotations

from schedcc.schedules.gpipe import GPipe

__all__ = ["LoopedBFS"]


class LoopedBFS(GPipe):
    """Looped BFS: v looped chunks per stage, each chunk's forwards (then backwards) at once."""

    name = "looped-bfs"

    default_num_chunks = 2
