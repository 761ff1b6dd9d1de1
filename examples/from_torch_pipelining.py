"""From torch.distributed.pipelining to schedcc: split a model, pick a schedule, step.

    python examples/from_torch_pipelining.py

A model with its layers in a `ModuleDict`, as torchtitan writes them, is cut by `schedcc.split`
before the layers named (torch's `pipeline(model, mb_args, split_spec={...: SplitPoint.BEGINNING})`)
and trained by three schedules torch also has: `1f1b` (`Schedule1F1B`), `interleaved-1f1b`
(`ScheduleInterleaved1F1B`) and `zb-v` (`ScheduleZBVZeroBubble`). Here the stages run in one
process on the local engine; the distributed `Engine` takes the same arguments on each rank.
In float64 every schedule gives the losses of the same model trained without a pipeline, which
this script checks; docs/migrating.md walks through it beside torch's code.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

import schedcc
from schedcc.backends.local import Engine

WIDTH, NUM_LAYERS, STEPS = 16, 4, 3


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(WIDTH, WIDTH) for i in range(NUM_LAYERS)})
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x):
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return self.out(x)


def batch(step: int):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(8, WIDTH, generator=gen)
    return x, x.sum(1, keepdim=True).sin()


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def pipelined(name: str, num_chunks: int) -> list[float]:
    """Train a fresh model with schedule `name`, 2 stages of `num_chunks` chunks each."""
    torch.manual_seed(0)
    model = Model()
    points = [f"layers.{k}" for k in range(1, 2 * num_chunks)]  # a segment per p * v
    segments = schedcc.split(model, points, example_inputs=(batch(0)[0],))
    schedule = schedcc.get_schedule(name)(num_stages=2, num_microbatches=4, num_chunks=num_chunks)
    engine = Engine(schedcc.compile(schedule), segments, F.mse_loss, optimizer)
    return [engine.train_step(*batch(step)) for step in range(STEPS)]


def unpipelined() -> list[float]:
    """The same model and data, no pipeline: each batch's loss is its 4 microbatches' mean."""
    torch.manual_seed(0)
    model = Model()
    opt = optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = sum(F.mse_loss(model(xs), ys) for xs, ys in zip(x.chunk(4), y.chunk(4))) / 4
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> int:
    torch.set_default_dtype(torch.float64)
    expected = unpipelined()
    for name, num_chunks in [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2)]:
        losses = pipelined(name, num_chunks)
        print(f"{name}: losses {' '.join(f'{loss:.12f}' for loss in losses)}")
        if max(abs(a - b) for a, b in zip(losses, expected)) > 1e-12:
            print(f"{name} differs from training without a pipeline: {expected}")
            return 1
    print(f"no pipeline: losses {' '.join(f'{loss:.12f}' for loss in expected)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
