"""Eager against compiled segments: time per optimizer step (a benchmark).

`--layers` x [Linear(W, 4W) + GELU + Linear(4W, W) + LayerNorm] (W = `--width`) cut into 2
segments by `schedcc.partition`, float32, MSE, AdamW, 1F1B with p = 2 and m = 4 on the local
engine (one process, every stage in it), microbatches of `--rows` rows. Each mode trains
`--warmup` steps (the compiled ones compile in them; the time that takes is printed) and then
`--rounds` timed steps; the table gives the median step beside eager's, and the ratio. Modes:
eager, `compile=True` (inductor), `compile="aot_eager"` (traced, not code-generated), and the
same with `recompute_layers=1`.

    .venv/bin/python benchmarks/compile_step.py [--width 256] [--layers 8] [--rows 16]
        [--rounds 20] [--modes eager inductor aot_eager eager+layers inductor+layers]
        [--device cpu|cuda]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))  # before torch is imported

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from _stamp import stamp
from torch import nn

import schedcc
from schedcc.backends.local import Engine

#: mode name -> (compile, recompute_layers)
MODES = {
    "eager": (False, None),
    "inductor": (True, None),
    "aot_eager": ("aot_eager", None),
    "eager+layers": (False, 1),
    "inductor+layers": (True, 1),
}
NUM_STAGES, NUM_MICROBATCHES = 2, 4


def _model(width: int, layers: int, device: str) -> list[nn.Module]:
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.LayerNorm(width)
        )
        for _ in range(layers)
    ]
    return schedcc.partition(nn.Sequential(*blocks).to(device), NUM_STAGES)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(mode: str, args) -> tuple[float, float, float]:
    """(seconds of the warmup steps, median seconds per timed step, last loss)."""
    backend, every = MODES[mode]
    program = schedcc.compile(schedcc.get_schedule("1f1b")(NUM_STAGES, NUM_MICROBATCHES))
    engine = Engine(
        program,
        _model(args.width, args.layers, args.device),
        F.mse_loss,
        lambda params: torch.optim.AdamW(params, lr=1e-3),
        compile=backend,
        recompute_layers=every,
    )
    gen = torch.Generator().manual_seed(1)
    rows = args.rows * NUM_MICROBATCHES
    x = torch.randn(rows, args.width, generator=gen).to(args.device)
    y = torch.randn(rows, args.width, generator=gen).to(args.device)
    start = time.perf_counter()
    for _ in range(args.warmup):
        engine.train_step(x, y)
    _sync(args.device)
    warmup = time.perf_counter() - start
    times, loss = [], float("nan")
    for _ in range(args.rounds):
        start = time.perf_counter()
        loss = engine.train_step(x, y)
        _sync(args.device)
        times.append(time.perf_counter() - start)
    return warmup, statistics.median(times), loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16, help="rows per microbatch")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    print(stamp("compile_step"))
    print(
        f"# width {args.width}, {args.layers} layers in {NUM_STAGES} segments, 1f1b m = "
        f"{NUM_MICROBATCHES}, {args.rows} rows a microbatch, {args.device}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'mode':<16} {'warmup s':>9} {'step ms':>9} {'eager ms':>9} {'ratio':>6} {'loss':>10}")
    eager = None
    for mode in args.modes:
        warmup, step, loss = _measure(mode, args)
        if mode == "eager":
            eager = step
        base = f"{eager * 1e3:9.2f} {step / eager:6.2f}" if eager else f"{'-':>9} {'-':>6}"
        print(f"{mode:<16} {warmup:9.1f} {step * 1e3:9.2f} {base} {loss:10.6f}", flush=True)


if __name__ == "__main__":
    main()
