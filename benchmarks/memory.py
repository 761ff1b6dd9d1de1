"""Measured against simulated peak bytes per stage: recomputation and ZeRO 0/1/2/3 (a benchmark).

8 x [Linear(512, 512) + ReLU] cut into p * v segments (p = 4; v = 2 for the interleaved, looped
and V-shaped schedules, 1 for the others), microbatches of 8 rows, float32, MSE, SGD with
momentum, on the local backend (one process; what a forward saves is counted with saved-tensor
hooks, as every engine does). For each built-in schedule at m = 8 and 16, with and without
`compile(..., recompute=True)`, one pipeline (dp = 1) and dp = 2 under ZeRO 0, 1, 2 and 3, it
trains two programs' worth of batches and measures, after every instruction of every stage of
the first replica, the bytes the stage holds: the storages behind its parameters, ZeRO shards
and 2BW's stashed weight versions, its gradients, its optimizer state and its saved
activations. It prints each stage's peak beside the simulator's (`Timeline.peak_bytes` under a
`MemoryModel` measured by `measure_memory` on one microbatch), the largest relative difference,
the peak activation bytes (measured) and the simulated makespan (F = 1, B = 2, I = W = 1,
R = F): what recomputation and ZeRO save and what recomputation costs in time.

    .venv/bin/python benchmarks/memory.py [--microbatches 8 16] [--schedules gpipe 1f1b ...]
        [--modes 1/0 2/0 2/1 2/2 2/3]

Then a summary: one line per (schedule, m, recompute), the largest stage's measured peak in MiB
under each mode and the largest difference in the row.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse
import weakref

import torch
import torch.nn.functional as F
from _stamp import stamp
from torch import nn

import schedcc
from schedcc.backends.local import Engine
from schedcc.backends.runtime.memory import measure_memory
from schedcc.costs import CostModel
from schedcc.errors import ScheduleConfigError
from schedcc.registry import build_schedule, registered_classes

WIDTH, LAYERS, ROWS, NUM_STAGES = 512, 8, 8, 4
MICROBATCHES = (8, 16)
#: (data-parallel replicas, ZeRO stage) pairs measured per schedule.
MODES = ((1, 0), (2, 0), (2, 1), (2, 2), (2, 3))
#: The schedules run with two chunks per stage (the others with one).
TWO_CHUNKS = {"interleaved-1f1b", "looped-bfs", "zb-v", "interleaved-zb"}


def _segments(num_segments: int) -> list[nn.Module]:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)]
    per = LAYERS // num_segments
    return [nn.Sequential(*layers[k * per : (k + 1) * per]) for k in range(num_segments)]


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


class _Meter:
    """The most bytes one stage runtime holds after any instruction (see the module doc)."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.peak = 0
        # 2BW's stashed copies, by storage: a graph keeps a copy's storage after the runtime
        # has dropped the tensor, so they are followed by weak references to the storages
        self._stashed: dict[int, tuple[int, int]] = {}  # data_ptr -> (weak ref, nbytes)
        self._follow_versions()
        reset = runtime.reset

        def resetting(*args, **kwargs) -> None:  # each run stashes on new `WeightVersions`
            reset(*args, **kwargs)
            self._follow_versions()

        runtime.reset = resetting
        run = runtime.run

        def measured(op) -> None:
            run(op)
            self.peak = max(self.peak, self.held())

        runtime.run = measured

    def _follow_versions(self) -> None:
        versions = self.runtime._versions
        mine = weakref.ref(versions)  # no cycle: the run's versions go when the run ends

        def stashing(c: int, version: int) -> None:
            live = mine()
            type(live).snapshot(live, c, version)
            self._follow(live._stash[c].get(version, {}).values())

        versions.snapshot = stashing
        for stash in versions._stash:  # version 0, stashed when the versions were made
            for params in stash.values():
                self._follow(params.values())

    def _follow(self, tensors) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            self._stashed[storage.data_ptr()] = (storage._weak_ref(), storage.nbytes())

    def held(self) -> int:
        runtime = self.runtime
        # what the stage trains: a tied parameter's private copy in place of the shared one,
        # whose storage the stage that trains it holds (and under ZeRO-3 releases)
        params = [p for view in runtime._views for p in view.parameters()]
        shards = list(runtime._reducer.shards)
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (*params, *shards)
        }
        for ptr, (ref, nbytes) in list(self._stashed.items()):
            if torch.UntypedStorage._expired(ref):
                torch.UntypedStorage._free_weak_ref(ref)
                del self._stashed[ptr]
            else:
                storages[ptr] = nbytes
        grads = {
            p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
            for p in (*params, *shards)
            if p.grad is not None
        }
        state = 0
        if runtime.optimizer is not None:
            for values in runtime.optimizer.state.values():
                state += sum(
                    v.numel() * v.element_size() for v in values.values() if torch.is_tensor(v)
                )
        return sum(storages.values()) + sum(grads.values()) + state + runtime.activation_bytes


def _row(name: str, cls, m: int, recompute: bool, dp: int, zero: int) -> tuple | None:
    v = 2 if name in TWO_CHUNKS and cls.supports_chunks(2) else None  # None: the class's default
    try:
        schedule = build_schedule(cls, NUM_STAGES, m, num_chunks=v)
    except ScheduleConfigError:  # e.g. dualpipe's m >= 2p
        return None
    v = schedule.num_chunks
    replicas = type(schedule).num_replicas  # DualPipe: the same modules again
    try:
        program = schedcc.compile(schedule, data_parallel=dp, zero=zero, recompute=recompute)
    except ScheduleConfigError:  # e.g. ZeRO-3 with 2BW's weight delay
        return None
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(dp * m * ROWS, WIDTH, generator=gen)
    y = torch.randn(dp * m * ROWS, WIDTH, generator=gen)
    parts = NUM_STAGES * v // replicas
    memory = measure_memory(_segments(parts), x[:ROWS], y[:ROWS], F.mse_loss, _sgd)
    engine = Engine(program, _segments(parts) * replicas, F.mse_loss, _sgd)
    meters = [_Meter(runtime) for runtime in engine.runtimes[0]]
    list(engine.train([(x, y)] * (2 * schedule.num_batches)))  # the 2nd with optimizer state
    measured = [meter.peak for meter in meters]
    timeline = schedcc.simulate(program, CostModel(memory=memory))
    simulated = timeline.peak_bytes
    error = max(abs(s - g) / g for s, g in zip(simulated, measured))
    activations = engine.peak_activation_bytes
    return (name, m, v, recompute, dp, zero, measured, simulated, error, activations,
            timeline.makespan)  # fmt: skip


def _print(header, table) -> None:
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    for r in [header, *table]:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())


def _mode(dp: int, zero: int) -> str:
    return "dp=1" if dp == 1 else f"dp={dp} zero={zero}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=list(MICROBATCHES))
    parser.add_argument("--schedules", nargs="+", default=None)
    parser.add_argument(
        "--modes",
        nargs="+",
        default=[f"{dp}/{zero}" for dp, zero in MODES],
        help="DP/ZERO pairs, e.g. 1/0 2/3",
    )
    args = parser.parse_args()
    modes = [tuple(int(n) for n in mode.split("/")) for mode in args.modes]
    torch.set_num_threads(1)
    classes = registered_classes()
    names = args.schedules or list(classes)
    print(stamp("memory"))
    print(
        f"p={NUM_STAGES}, {LAYERS} x Linear({WIDTH}) + ReLU, microbatch {ROWS} rows, float32, "
        "SGD with momentum; peak bytes per stage (parameters, shards, stashes, gradients, "
        "optimizer state, activations), measured | simulated"
    )
    rows = []
    for name in names:
        cls = classes.get(name) or schedcc.get_schedule(name)
        for m in args.microbatches:
            for recompute in (False, True):
                for dp, zero in modes:
                    row = _row(name, cls, m, recompute, dp, zero)
                    if row is not None:
                        rows.append(row)
    header = ("schedule", "m", "v", "recompute", "mode", "measured KiB", "simulated KiB",
              "max err", "activations KiB", "makespan")  # fmt: skip
    _print(header, [_cells(row) for row in rows])
    print()
    _summary(rows, modes)
    worst = max(row[8] for row in rows)
    print(f"largest measured-vs-simulated difference: {100 * worst:.2f}%")


def _cells(row) -> tuple[str, ...]:
    name, m, v, recompute, dp, zero, measured, simulated, error, activations, makespan = row
    return (
        name,
        str(m),
        str(v),
        "yes" if recompute else "no",
        _mode(dp, zero),
        " ".join(f"{b / 1024:.0f}" for b in measured),
        " ".join(f"{b / 1024:.0f}" for b in simulated),
        f"{100 * error:.1f}%",
        " ".join(f"{b / 1024:g}" for b in activations),
        f"{makespan:g}",
    )


def _summary(rows, modes) -> None:
    """One line per (schedule, m, recompute): the largest stage's measured peak per mode."""
    header = ("schedule", "m", "recompute", *(_mode(dp, zero) for dp, zero in modes), "max err")
    groups: dict[tuple, dict] = {}
    for name, m, _, recompute, dp, zero, measured, _, error, _, _ in rows:
        group = groups.setdefault((name, m, recompute), {})
        group[(dp, zero)] = (max(measured), error)
    table = []
    for (name, m, recompute), group in groups.items():
        cells = [f"{group[mode][0] / 2**20:.2f}" if mode in group else "-" for mode in modes]
        worst = max(error for _, error in group.values())
        table.append((name, str(m), "yes" if recompute else "no", *cells, f"{100 * worst:.1f}%"))
    print("largest stage's measured peak, MiB")
    _print(header, table)


if __name__ == "__main__":
    main()
