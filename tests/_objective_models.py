"""`--model` factories for `schedcc run --check` (tests/models/test_check_objective.py): a tiny
language model on padded rows, whose loss is a padded per-microbatch mean, a `(loss_sum, count)`
pair or a `schedcc.TokenLoss`, and whose blocks may round in float32 inside or hold dropout.

    schedcc run --model tests/_objective_models.py:padded_mean --check
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import schedcc
from schedcc.backends.run.models import RunModel

__all__ = [
    "TOKEN_LOSS",
    "batch",
    "dropout",
    "padded_mean",
    "plain_ratio",
    "segments",
    "token_loss",
    "tokens",
]

VOCAB, WIDTH, LENGTH = 11, 8, 6
IGNORE = -100


class Float32Norm(nn.Module):
    """RMSNorm as HF's Llama writes it: computed in float32 whatever the model's dtype."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class Block(nn.Module):
    """Residual: a norm (float32 inside, or none), a Linear, a tanh, maybe dropout."""

    def __init__(self, *, float32: bool, p: float) -> None:
        super().__init__()
        self.norm = Float32Norm(WIDTH) if float32 else nn.Identity()
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.mix(self.norm(x))))


def segments(num_segments: int, seed: int, *, float32: bool = False, p: float = 0.0) -> list:
    """Embedding and a block, blocks, a block and the head: `num_segments` of them."""
    torch.manual_seed(seed)
    blocks = [Block(float32=float32, p=p) for _ in range(num_segments)]
    blocks[0] = nn.Sequential(nn.Embedding(VOCAB, WIDTH), blocks[0])
    blocks[-1] = nn.Sequential(blocks[-1], nn.Linear(WIDTH, VOCAB))
    return blocks


def batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and targets; row r keeps `1 + (r*r + step) % LENGTH` targets, the rest
    padding (`IGNORE`), so microbatches hold different numbers of real tokens."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randint(VOCAB, (batch_size, LENGTH), generator=gen)
    y = torch.randint(VOCAB, (batch_size, LENGTH), generator=gen)
    rows = torch.arange(batch_size)
    kept = 1 + (rows * rows + step) % LENGTH
    y[torch.arange(LENGTH) >= kept[:, None]] = IGNORE
    return x, y


def _mean(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)


def _sum(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")


def tokens(y: torch.Tensor) -> torch.Tensor:
    """The real (not padding) targets."""
    return (y != IGNORE).sum()


def _ratio(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _sum(logits, y), tokens(y)


#: The loss `token_loss` trains: the batch's token ratio, its count known up front.
TOKEN_LOSS = schedcc.TokenLoss(_sum, tokens)


def padded_mean(num_segments: int, *, seed: int) -> RunModel:
    """The usual mean cross-entropy over each microbatch's real tokens."""
    return RunModel(segments(num_segments, seed), _mean, batch, unit="samples")


def plain_ratio(num_segments: int, *, seed: int) -> RunModel:
    """A `(loss_sum, count)` loss on blocks that round in float32 inside."""
    return RunModel(segments(num_segments, seed, float32=True), _ratio, batch)


def token_loss(num_segments: int, *, seed: int) -> RunModel:
    """The same, given as a `schedcc.TokenLoss`."""
    return RunModel(segments(num_segments, seed, float32=True), TOKEN_LOSS, batch)


def dropout(num_segments: int, *, seed: int) -> RunModel:
    """The padded mean on blocks with dropout 0.1 (as HF configs default to)."""
    return RunModel(segments(num_segments, seed, p=0.1), _mean, batch)
