"""A small float64 model whose last segment uses the first segment's weight (a tied head), for
the tied-parameter tests: segment 0 embeds with `W`, the middle ones are Linear + Tanh, the
last projects back with the same `W` (transposed). Boundaries are single float tensors."""

from __future__ import annotations

import _models
import torch
from _models import mse
from torch import nn

__all__ = ["WIDTH", "Embed", "Head", "adam", "batches", "mse", "tied_segments"]

WIDTH = 4


class Embed(nn.Module):
    """`tanh(x @ W.T + b)`, holding the tied `W`."""

    def __init__(self, weight: nn.Parameter, gen: torch.Generator) -> None:
        super().__init__()
        self.weight = weight
        self.bias = nn.Parameter(torch.randn(weight.shape[0], generator=gen, dtype=weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight.T + self.bias)


class Head(nn.Module):
    """`x @ W`: the tied `W` again, transposed (as an LM head reuses the embedding)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def tied_segments(num_segments: int, *, seed: int = 0, width: int = WIDTH) -> list[nn.Module]:
    """`num_segments` float64 segments, the first and last sharing one Parameter."""
    gen = torch.Generator().manual_seed(seed)
    weight = nn.Parameter(torch.randn(width, width, generator=gen, dtype=torch.float64))
    middle = []
    for _ in range(num_segments - 2):
        linear = nn.Linear(width, width, dtype=torch.float64)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(width, width, generator=gen, dtype=torch.float64))
            linear.bias.copy_(torch.randn(width, generator=gen, dtype=torch.float64))
        middle.append(nn.Sequential(linear, nn.Tanh()))
    return [Embed(weight, gen), *middle, Head(weight)]


def batches(num_batches: int, batch_size: int, *, seed: int = 1, width: int = WIDTH):
    """`num_batches` (inputs, targets) pairs of float64 data of this model's width."""
    return _models.batches(num_batches, batch_size, seed=seed, width=width)


def adam(params):
    """Adam, lr 0.05: its state makes a doubly stepped or drifting copy visible."""
    return torch.optim.Adam(params, lr=0.05)
