"""Your own model in `schedcc run`: a small character-level language model.

    schedcc run --model examples/char_lm.py:make
    schedcc run --model examples/char_lm.py:make -p 4 --steps 100
    schedcc run --model examples/char_lm.py:make --schedule interleaved-1f1b -v 2 --check
    schedcc run --model examples/char_lm.py:make --steps 100 --eval-every 20

`make(num_segments, *, seed, segments=None)` builds the model, cuts it into `num_segments`
segments with `schedcc.split` and returns them with the loss, the data (the text's last fifth held
out for `--eval-every`) and an optimizer as a `RunModel`. The LM head's weight is the embedding's,
so the first and the last segment hold the same Parameter: the run finds that tie and compiles
with `tied=` by itself. The contract is in `schedcc.backends.run.models`.

Each rank of the run asks only for its own stage's `segments`: the model is then made on the
meta device (shapes, no memory), cut there, and only those segments are given memory
(`to_empty`) and values. Every parameter is drawn from a generator seeded by the seed and its
name, so a segment built alone starts as it does in the whole model, and the head, built apart
from the embedding, starts as a copy of it (the run finds that copy by value).
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

import schedcc
from schedcc.backends.run.models import RunModel
from schedcc.splitting import even_points

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
    "of despair."
)
CHARS = sorted(set(TEXT))
IDS = torch.tensor([CHARS.index(c) for c in TEXT])
WINDOW = 24
SPLIT = len(IDS) * 4 // 5  # training reads the text before it; evaluation the rest


class Block(nn.Module):
    """Residual: each position mixes itself with the two before it, then an MLP."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(3 * width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        past = F.pad(h, (0, 0, 2, 0))  # two zero positions in front of the sequence
        x = x + self.mix(torch.cat((h, past[:, 1:-1], past[:, :-2]), dim=-1))
        return x + self.mlp(x)


class CharLM(nn.Module):
    def __init__(self, vocab: int, width: int = 32, depth: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, chars: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(chars))))


def batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` windows of the training text and the characters that follow them."""
    return _windows(IDS[:SPLIT], batch_size, step)


def held_out(batch_size: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k-th held-out batch: windows of the text's last fifth, which training never reads."""
    return _windows(IDS[SPLIT:], batch_size, k)


def _windows(ids: torch.Tensor, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)  # a pure function of the seed
    starts = torch.randint(len(ids) - WINDOW, (batch_size,), generator=gen)
    windows = torch.stack([ids[s : s + WINDOW + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make(num_segments: int, *, seed: int, segments: tuple[int, ...] | None = None) -> RunModel:
    with torch.device("meta"):  # shapes only: memory is given below, to what is asked for
        model = CharLM(len(CHARS), depth=max(4, num_segments))
    cut = schedcc.split(model, even_points(model, num_segments, container="blocks"))
    if segments is None or num_segments == 1:
        model.to_empty(device="cpu")
        model.head.weight = model.embed.weight  # to_empty gives each module its own tensor
        _draw(model, seed)
        built = cut if segments is None else {0: cut[0]}
    else:
        built = {k: cut[k].to_empty(device="cpu") for k in segments}
        for segment in built.values():
            _draw(segment, seed)
    return RunModel(
        built,
        loss,
        batch,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        count=lambda chars, targets: targets.numel(),
        unit="characters",
        eval_batch=held_out,
    )


def _draw(module: nn.Module, seed: int) -> None:
    """Each parameter's value, from a generator seeded by `seed` and its name in the model (the
    head's weight is the embedding's): embeddings normal(0, 0.1), `Linear`s as PyTorch draws
    them (uniform within `1/sqrt(fan_in)`), norms ones and zeros."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            name = "embed.weight" if name == "head.weight" else name
            digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)
            if name == "embed.weight":
                param.normal_(0.0, 0.1, generator=gen)
            elif "norm" in name:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                fan_in = module.get_parameter(_weight_of(name)).shape[1]
                param.uniform_(-(fan_in**-0.5), fan_in**-0.5, generator=gen)


def _weight_of(name: str) -> str:
    """The weight of the `Linear` that parameter `name` belongs to."""
    return name.rpartition(".")[0] + ".weight"
