"""Tiny float64 models, data and optimizers for the backend tests."""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "WIDTH", "batches", "largest_difference", "make_segments", "mse", "schedule_segments", "sgd",
]

WIDTH = 3


def make_segments(num_segments: int, *, seed: int = 0, width: int = WIDTH) -> list[nn.Module]:
    """`num_segments` small float64 segments (Linear + Tanh), deterministic for `seed`."""
    gen = torch.Generator().manual_seed(seed)
    segments = []
    for _ in range(num_segments):
        linear = nn.Linear(width, width, dtype=torch.float64)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(width, width, generator=gen, dtype=torch.float64))
            linear.bias.copy_(torch.randn(width, generator=gen, dtype=torch.float64))
        segments.append(nn.Sequential(linear, nn.Tanh()))
    return segments


def schedule_segments(schedule, *, seed: int = 0) -> list[nn.Module]:
    """`make_segments` for `schedule`'s segments: with model replicas (DualPipe), one replica's
    segments repeated, each copy the same module (what `ReduceTied` keeps equal)."""
    replicas = type(schedule).num_replicas
    return make_segments(schedule.num_segments // replicas, seed=seed) * replicas


def batches(num_batches: int, batch_size: int, *, seed: int = 1, width: int = WIDTH):
    """`num_batches` (inputs, targets) pairs of float64 data."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch_size, width, generator=gen, dtype=torch.float64),
            torch.randn(batch_size, width, generator=gen, dtype=torch.float64),
        )
        for _ in range(num_batches)
    ]


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error (a mean over the microbatch)."""
    return torch.nn.functional.mse_loss(output, target)


def sgd(params):
    """Plain SGD, lr 0.1."""
    return torch.optim.SGD(params, lr=0.1)


def linear_segments(num_segments: int, *, width: int = 4, seed: int = 0) -> list[nn.Module]:
    """`num_segments` float64 `Linear(width, width)` segments, seeded."""
    torch.manual_seed(seed)
    return [nn.Linear(width, width, dtype=torch.float64) for _ in range(num_segments)]


def tanh_batches(count: int, size: int = 8, *, width: int = 4, seed: int = 1) -> list:
    """`count` float64 `(x, tanh(x flipped))` batches of `size` rows."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(size, width, generator=gen, dtype=torch.float64)
        out.append((x, torch.tanh(x.flip(-1))))
    return out


def largest_difference(losses, expected, segments, reference) -> float:
    """The largest absolute difference between two runs: their losses, and every parameter of
    `segments` against the same one of `reference`."""
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    for got, want in zip(segments, reference):
        for a, b in zip(got.parameters(), want.parameters()):
            worst = max(worst, (a - b).abs().max().item())
    return worst
