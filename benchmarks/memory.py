"""Measured against simulated activation memory, with and without recomputation (a benchmark).

8 x [Linear(512, 512) + ReLU] cut into p * v segments (p = 4; v = 2 for the interleaved, looped
and V-shaped schedules, 1 for the others), microbatches of 8 rows, float32, MSE, SGD, on the
local backend (one process; what a forward saves is counted with saved-tensor hooks, as every
engine does). For each built-in schedule at m = 8 and 16, with and without
`compile(..., recompute=True)`, it trains one step and prints the engine's measured peak
activation bytes per stage beside the simulator's (`Timeline.peak_activation_bytes` under a
`MemoryModel` measured by `measure_memory` on one microbatch), the largest relative difference,
and the simulated makespan (F = 1, B = 2, I = W = 1, R = F): the memory recomputation saves and
the time it costs.

    .venv/bin/python benchmarks/memory.py [--microbatches 8 16] [--schedules gpipe 1f1b ...]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse

import torch
import torch.nn.functional as F
from _stamp import stamp
from torch import nn

import schedcc
from schedcc.backends.local import Engine
from schedcc.backends.runtime.memory import measure_memory
from schedcc.costs import CostModel
from schedcc.registry import registered_classes
from schedcc.schedule import uses_chunks

WIDTH, LAYERS, ROWS, NUM_STAGES = 512, 8, 8, 4
MICROBATCHES = (8, 16)
#: The schedules run with two chunks per stage (the others with one).
TWO_CHUNKS = {"interleaved-1f1b", "looped-bfs", "zb-v", "interleaved-zb"}


def _segments(num_segments: int) -> list[nn.Module]:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)]
    per = LAYERS // num_segments
    return [nn.Sequential(*layers[k * per : (k + 1) * per]) for k in range(num_segments)]


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-3)


def _row(name: str, cls, m: int, recompute: bool) -> tuple:
    v = 2 if name in TWO_CHUNKS and uses_chunks(cls) else 1
    schedule = cls(NUM_STAGES, m, v)
    program = schedcc.compile(schedule, recompute=recompute)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m * ROWS, WIDTH, generator=gen)
    y = torch.randn(m * ROWS, WIDTH, generator=gen)
    memory = measure_memory(_segments(NUM_STAGES * v), x[:ROWS], y[:ROWS], F.mse_loss)
    engine = Engine(program, _segments(NUM_STAGES * v), F.mse_loss, _sgd)
    list(engine.train([(x, y)] * schedule.num_batches))
    measured = engine.peak_activation_bytes
    timeline = schedcc.simulate(program, CostModel(memory=memory))
    simulated = timeline.peak_activation_bytes
    error = max(abs(s - g) / g for s, g in zip(simulated, measured))
    return (name, m, v, recompute, measured, simulated, error, timeline.makespan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=list(MICROBATCHES))
    parser.add_argument("--schedules", nargs="+", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    classes = registered_classes()
    names = args.schedules or list(classes)
    print(stamp("memory"))
    print(
        f"p={NUM_STAGES}, {LAYERS} x Linear({WIDTH}) + ReLU, microbatch {ROWS} rows, float32; "
        "peak activation bytes per stage in KiB, measured | simulated"
    )
    header = (
        "schedule",
        "m",
        "v",
        "recompute",
        "measured KiB",
        "simulated KiB",
        "max err",
        "makespan",
    )
    rows = []
    for name in names:
        cls = classes.get(name) or schedcc.get_schedule(name)
        for m in args.microbatches:
            for recompute in (False, True):
                rows.append(_row(name, cls, m, recompute))
    table = [
        (
            name,
            str(m),
            str(v),
            "yes" if recompute else "no",
            " ".join(f"{b / 1024:g}" for b in measured),
            " ".join(f"{b / 1024:g}" for b in simulated),
            f"{100 * error:.1f}%",
            f"{makespan:g}",
        )
        for name, m, v, recompute, measured, simulated, error, makespan in rows
    ]
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    for r in [header, *table]:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    worst = max(row[6] for row in rows)
    print(f"largest measured-vs-simulated difference: {100 * worst:.1f}%")


if __name__ == "__main__":
    main()
