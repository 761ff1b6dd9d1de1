"""A small causal-attention GPT cut into segments that take sequence parts (float64).

Each segment is called as `segment(x, carry)` and returns `(out, carry)` ([Note: the parts'
calling convention] in `schedcc.backends.runtime.carries`): its attention's keys and values over
every position so far are the carry, so part j + 1 attends to part j's positions as the whole
sequence would. `train_whole` is non-pipelined training of the unsplit sequence, the oracle.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, SEQ = 11, 8, 8


class Block(nn.Module):
    """One pre-norm transformer block with single-head causal attention."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor, carry):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        if carry is not None:  # the keys and values of the earlier parts
            k, v = torch.cat([carry[0], k], dim=1), torch.cat([carry[1], v], dim=1)
        offset, length = k.shape[1] - x.shape[1], x.shape[1]
        scores = q @ k.transpose(1, 2) / math.sqrt(x.shape[-1])
        rows = torch.arange(length).unsqueeze(1) + offset
        scores = scores.masked_fill(torch.arange(k.shape[1]).unsqueeze(0) > rows, float("-inf"))
        x = x + self.proj(scores.softmax(dim=-1) @ v)
        return x + self.mlp(self.norm2(x)), (k, v)


class Segment(nn.Module):
    """A block, with the token and position embedding first on segment 0 and the head last on
    the last segment."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH) if first else None
        self.position = nn.Embedding(SEQ, WIDTH) if first else None
        self.block = Block(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB) if last else None

    def forward(self, x: torch.Tensor, carry=None):
        if self.embed is not None:
            offset = 0 if carry is None else carry[0].shape[1]
            positions = torch.arange(offset, offset + x.shape[1])
            x = self.embed(x) + self.position(positions)
        x, carry = self.block(x, carry)
        return (self.head(x) if self.head is not None else x), carry


def gpt_segments(num_segments: int, *, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [Segment(k == 0, k == num_segments - 1).double() for k in range(num_segments)]


def token_batches(count: int, size: int, *, seed: int = 1) -> list[tuple]:
    """`count` batches of `size` sequences of SEQ tokens, each target the next token."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(VOCAB, (size, SEQ + 1), generator=generator)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def token_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, a mean over every token."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def sgd(params):
    return torch.optim.SGD(params, lr=0.3)


def train_whole(segments: list[nn.Module], batches) -> list[float]:
    """Non-pipelined training of the unsplit sequences: one SGD step per batch; its losses."""
    params = [p for segment in segments for p in segment.parameters()]
    optimizer = sgd(params)
    losses = []
    for inputs, targets in batches:
        x = inputs
        for segment in segments:
            x, _ = segment(x)
        loss = token_loss(x, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
