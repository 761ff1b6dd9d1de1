"""Offloading activations: the simulated time and device memory of 1F1B with and without it, by
the cost of a copy (a benchmark).

p = 8, m = 32, F = 1, B = 2, one activation = 1 unit of bytes. For each copy cost (an `Offload`
and a `Reload` each take it, on the stage's copy lane), it prints the makespan under rendezvous
and eager simulation, the largest stage's peak device activations and its peak host ones, for
1f1b, 1f1b-offload (PipeOffload's selective offload), 1f1b with `offload=0.5` (half of the
offloadable forwards per stage, the longest-held) and interleaved-1f1b (v = 2) with
`offload=True`. Then the same measured on the local engine (CPU, float64, 16-wide Linear + Tanh
segments, p = 4, m = 8): peak device and host activation bytes per stage.

    .venv/bin/python benchmarks/offload.py [--copies 0.25 0.5 1 1.5 2]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse

import torch
from _stamp import stamp
from torch import nn

import schedcc
from schedcc import CostModel, MemoryModel
from schedcc.backends.local import Engine

P, M = 8, 32
UNIT = 64  # bytes of one stage's activation (v = 2: half of it per chunk)
CASES = [
    ("1f1b", 1, False),
    ("1f1b-offload", 1, False),
    ("1f1b", 1, 0.5),
    ("interleaved-1f1b", 2, False),
    ("interleaved-1f1b", 2, True),
]


def simulated(copies: list[float]) -> None:
    print(f"simulated, p={P} m={M}, F=1 B=2; peak activations of the largest stage")
    print("| copy | schedule | offload | makespan | eager | device peak | host peak |")
    print("|---|---|---|---|---|---|---|")
    for copy in copies:
        for name, v, offload in CASES:
            program = schedcc.compile(schedcc.get_schedule(name)(P, M, v), offload=offload)
            memory = MemoryModel(activations=UNIT // v, parameters=0)
            costs = CostModel(
                forward=1 / v, backward=2 / v, offload=copy / v, reload=copy / v, memory=memory
            )
            rendezvous = schedcc.simulate(program, costs)
            eager = schedcc.simulate(program, costs, eager=True)
            print(
                f"| {copy:g} | {name} | {offload} | {rendezvous.makespan:g} | {eager.makespan:g} "
                f"| {max(rendezvous.peak_activation_bytes) / UNIT:g} "
                f"| {max(rendezvous.peak_host_bytes) / UNIT:g} |"
            )


def measured() -> None:
    p, m, width = 4, 8, 16

    def segments():
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        out = []
        for _ in range(p):
            layer = nn.Linear(width, width, dtype=torch.float64)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(width, width, generator=gen, dtype=torch.float64))
            out.append(nn.Sequential(layer, nn.Tanh()))
        return out

    x = torch.randn(4 * m, width, dtype=torch.float64)
    y = torch.randn(4 * m, width, dtype=torch.float64)
    print(f"\nmeasured, local engine, p={p} m={m}, Linear({width}) + Tanh, float64")
    print("| schedule | device bytes per stage | host bytes per stage | loss |")
    print("|---|---|---|---|")
    for name in ("1f1b", "1f1b-offload"):
        program = schedcc.compile(schedcc.get_schedule(name)(p, m))
        engine = Engine(
            program, segments(), nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1)
        )
        loss = engine.train_step(x, y)
        hosts = [rt.peak_host_activation_bytes for rt in engine.runtimes[0]]
        print(f"| {name} | {engine.peak_activation_bytes} | {hosts} | {loss:.15f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=float, nargs="+", default=[0.25, 0.5, 1.0, 1.5, 2.0])
    args = parser.parse_args()
    print(stamp("offload"))
    simulated(args.copies)
    measured()


if __name__ == "__main__":
    main()
