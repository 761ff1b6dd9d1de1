"""Built-in models and data for `schedcc run`: a tiny GPT, an MLP, and seeded synthetic data.

The GPT learns token sequences drawn from a fixed random bigram model, so the best loss any model
can reach is known exactly: the bigram conditional entropy (`BigramData.entropy`). The MLP learns
a fixed random linear teacher plus Gaussian noise, whose floor is the noise variance. Both models
come already cut into segments (`num_segments` modules in model order): the embedding sits in the
first segment, the head in the last, the blocks spread evenly between.

    >>> data = BigramData(vocab=16, seq_len=8, seed=0)
    >>> inputs, targets = data.batch(4, step=0)
    >>> tuple(inputs.shape), round(data.entropy, 3) < math.log(16)
    ((4, 8), True)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MODELS",
    "BigramData",
    "Built",
    "TeacherData",
    "build",
    "lm_loss",
    "mlp_segments",
    "split_evenly",
    "tiny_gpt_segments",
]


# -- data ----------------------------------------------------------------------------------------


class BigramData:
    """Token sequences from a seeded random bigram model; `entropy` is the best achievable loss.

    The first token of each sequence is drawn from the chain's stationary distribution, so every
    position has the same marginal and the floor is `sum_a pi(a) * H(next | a)` nats per token.

    Args:
        vocab: number of tokens.
        seq_len: tokens per input sequence (targets are the inputs shifted by one).
        seed: fixes the transition table; `batch(n, step)` is a pure function of (seed, step).
        sharpness: scale of the random transition logits (higher: peakier, lower entropy).
    """

    def __init__(self, vocab: int = 64, seq_len: int = 32, seed: int = 0, sharpness: float = 2.5):
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab, vocab, generator=gen, dtype=torch.float64) * sharpness
        self.transition = logits.softmax(dim=-1)
        self.stationary = _stationary(self.transition)
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed

    @property
    def entropy(self) -> float:
        """The bigram conditional entropy in nats: the loss floor of next-token prediction."""
        row_entropy = -(self.transition * self.transition.log()).sum(dim=-1)
        return float((self.stationary * row_entropy).sum())

    def batch(self, batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(inputs, targets)` of shape `(batch_size, seq_len)`, a pure function of `step`."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.multinomial(self.stationary, batch_size, True, generator=gen)
        for t in range(self.seq_len):
            rows = self.transition[tokens[:, t]]
            tokens[:, t + 1] = torch.multinomial(rows, 1, generator=gen).squeeze(1)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class TeacherData:
    """Inputs `x ~ N(0, 1)` and targets `x @ W + noise`; `entropy` here is the MSE floor."""

    def __init__(self, width: int = 32, seed: int = 0, noise: float = 0.1):
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(width, width, generator=gen, dtype=torch.float64) / width**0.5
        self.width, self.seed, self.noise = width, seed, noise

    @property
    def entropy(self) -> float:
        """The noise variance: the lowest mean squared error any model can reach."""
        return self.noise**2

    def batch(self, batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(x, y)`, each `(batch_size, width)` in the default dtype; a pure function of `step`."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        x = torch.randn(batch_size, self.width, generator=gen, dtype=torch.float64)
        noise = torch.randn(batch_size, self.width, generator=gen, dtype=torch.float64)
        y = x @ self.weight + self.noise * noise
        dtype = torch.get_default_dtype()
        return x.to(dtype), y.to(dtype)


def _stationary(transition: torch.Tensor) -> torch.Tensor:
    pi = torch.full((transition.shape[0],), 1.0 / transition.shape[0], dtype=transition.dtype)
    for _ in range(1000):
        nxt = pi @ transition
        if torch.allclose(nxt, pi, atol=1e-15, rtol=0):
            break
        pi = nxt
    return pi / pi.sum()


# -- models --------------------------------------------------------------------------------------


class Embedding(nn.Module):
    """Token plus learned position embedding: `(batch, seq) -> (batch, seq, d_model)`."""

    def __init__(self, vocab: int, seq_len: int, d_model: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens) + self.positions[: tokens.shape[1]]


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention then an MLP, both residual."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        shape = (batch, seq, self.num_heads, width // self.num_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(shape[-1])
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """Final layer norm and the vocabulary projection: `(b, s, d) -> (b, s, vocab)` logits."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def split_evenly(layers: list[nn.Module], num_segments: int) -> list[nn.Module]:
    """`layers` cut into `num_segments` contiguous `nn.Sequential`s, sizes differing by <= 1.

    Raises:
        ValueError: fewer layers than segments.
    """
    if num_segments > len(layers):
        raise ValueError(
            f"cannot cut {len(layers)} layers into {num_segments} segments; "
            "use fewer stages/chunks or a deeper model"
        )
    base, extra = divmod(len(layers), num_segments)
    out, start = [], 0
    for k in range(num_segments):
        size = base + (1 if k < extra else 0)
        out.append(nn.Sequential(*layers[start : start + size]))
        start += size
    return out


def tiny_gpt_segments(
    num_segments: int,
    *,
    vocab: int = 64,
    seq_len: int = 32,
    d_model: int = 64,
    num_heads: int = 4,
    num_blocks: int | None = None,
    seed: int = 0,
) -> list[nn.Module]:
    """A small GPT cut into `num_segments` segments (embedding first, head last).

    `num_blocks` defaults to `max(4, num_segments)` so every segment holds at least one block;
    the embedding joins the first block's segment and the head the last one's.
    """
    torch.manual_seed(seed)
    num_blocks = num_blocks or max(4, num_segments)
    blocks: list[nn.Module] = [Block(d_model, num_heads) for _ in range(num_blocks)]
    blocks[0] = nn.Sequential(Embedding(vocab, seq_len, d_model), blocks[0])
    blocks[-1] = nn.Sequential(blocks[-1], Head(d_model, vocab))
    return split_evenly(blocks, num_segments)


def mlp_segments(
    num_segments: int, *, width: int = 32, num_layers: int | None = None, seed: int = 0
) -> list[nn.Module]:
    """An MLP of `Linear(width, width)` + `Tanh` layers (the last without), cut evenly."""
    torch.manual_seed(seed)
    num_layers = num_layers or max(4, num_segments)
    layers: list[nn.Module] = []
    for index in range(num_layers):
        last = index == num_layers - 1
        linear = nn.Linear(width, width)
        layers.append(linear if last else nn.Sequential(linear, nn.Tanh()))
    return split_evenly(layers, num_segments)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over a microbatch of `(b, s, vocab)` logits."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Built:
    """A built-in model ready to train: `segments`, `loss_fn`, `data` (with `entropy`), sizes."""

    def __init__(self, segments, loss_fn, data, tokens_per_sample: int):
        self.segments: list[nn.Module] = segments
        self.loss_fn: Callable = loss_fn
        self.data = data
        self.tokens_per_sample = tokens_per_sample


def build(name: str, num_segments: int, *, seed: int = 0) -> Built:
    """The built-in model `name` ("tiny-gpt" or "mlp") cut into `num_segments` segments.

    Raises:
        ValueError: an unknown name, or more segments than the model has layers.
    """
    if name == "tiny-gpt":
        data = BigramData(seed=seed)
        segments = tiny_gpt_segments(num_segments, vocab=data.vocab, seq_len=data.seq_len)
        return Built(segments, lm_loss, data, data.seq_len)
    if name == "mlp":
        data = TeacherData(seed=seed)
        segments = mlp_segments(num_segments, width=data.width)
        return Built(segments, F.mse_loss, data, 1)
    raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")


MODELS = ("tiny-gpt", "mlp")
