"""From DeepSpeed's pipeline engine to schedcc: the same training, on 2 gloo ranks.

    python examples/from_deepspeed.py

The model is DeepSpeed's usual shape: a list of layers, an embedding first and an LM head last
that shares the embedding's weight (`TiedLayerSpec` there, one Parameter here). Each rank builds
only its own stage's layers (`LayerSpec` there, a builder `build(k)` here), and reads only the
data its stage needs. The run clips gradients, recomputes each layer, follows a learning-rate
schedule and saves a checkpoint that `schedcc.export` reads back as one state dict. In float64
the pipeline's losses equal those of the same layers trained on schedcc's local engine, which
this script checks; docs/migrating.md walks through it beside DeepSpeed's code.
"""

from __future__ import annotations

import sys
import tempfile
from collections import OrderedDict
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import schedcc
from schedcc.backends.distributed import Engine
from schedcc.backends.local import Engine as LocalEngine
from schedcc.backends.run.launch import spawn

VOCAB, WIDTH, NUM_LAYERS, LENGTH = 16, 16, 6, 8
STEPS, NUM_MICROBATCHES = 4, 4


class Block(nn.Module):
    """A residual MLP block."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)
        )

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Head(nn.Module):
    """The LM head: logits from the embedding's weight (`weight` may be the embedding's)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(VOCAB, WIDTH))

    def forward(self, x):
        return x @ self.weight.T


def layer(i: int) -> nn.Module:
    """Layer `i` alone, its values a function of `i` (the head starts as the embedding)."""
    torch.manual_seed(0 if i == NUM_LAYERS - 1 else i)
    if i == 0:
        return nn.Embedding(VOCAB, WIDTH)
    if i == NUM_LAYERS - 1:
        head = Head()
        nn.init.normal_(head.weight)  # nn.Embedding's init, from the embedding's seed
        return head
    return Block()


def whole_model() -> list[nn.Sequential]:
    """All layers, the head tied to the embedding, cut by parameter counts."""
    layers = [layer(i) for i in range(NUM_LAYERS)]
    layers[-1].weight = layers[0].weight  # one Parameter: TiedLayerSpec("embed", ...)
    return schedcc.partition(nn.Sequential(*layers), 2)  # partition_method="parameters"


CUTS = [0, 3, NUM_LAYERS]  # where whole_model's segments start (layer indices)


def build(k: int) -> nn.Sequential:
    """Segment `k` alone, its layers keeping their names in the whole model (LayerSpec)."""
    lo, hi = CUTS[k], CUTS[k + 1]
    return nn.Sequential(OrderedDict((str(i), layer(i)) for i in range(lo, hi)))


def batch(step: int):
    """`(tokens, next tokens)`: counting sequences with a random start and stride."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (8, 1), generator=gen)
    stride = torch.randint(1, 4, (8, 1), generator=gen)
    tokens = (start + stride * torch.arange(LENGTH + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)


def lr_scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))


def program() -> schedcc.Program:
    schedule = schedcc.get_schedule("1f1b")(num_stages=2, num_microbatches=NUM_MICROBATCHES)
    return schedcc.compile(schedule, tied=[(0, 1)], grad_norm=True)


def train(rank: int, world_size: int, checkpoint: str) -> None:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(60))
    engine = Engine(
        program(),
        build,
        loss_fn,
        optimizer,
        max_grad_norm=1.0,
        lr_scheduler=lr_scheduler,
        recompute_layers=1,  # activation_checkpoint_interval=1
    )
    first, last = engine.stage == 0, engine.stage == 1
    for step in range(STEPS):
        inputs, targets = batch(step)
        loss = engine.train_step(inputs if first else None, targets if last else None)
        if last:
            print(f"pipeline step {step}: loss {loss:.12f}")
    engine.save(f"{checkpoint}/step-{STEPS:08d}")
    dist.destroy_process_group()


def reference() -> list[float]:
    """The same training on the local engine, from the whole model."""
    torch.set_default_dtype(torch.float64)
    engine = LocalEngine(
        program(), whole_model(), loss_fn, optimizer, max_grad_norm=1.0, lr_scheduler=lr_scheduler
    )
    return [engine.train_step(*batch(step)) for step in range(STEPS)]


def main() -> int:
    with tempfile.TemporaryDirectory() as checkpoint:
        code = spawn(train, 2, (checkpoint,), threads=1)
        if code:
            return code
        state = schedcc.export(f"{checkpoint}/step-{STEPS:08d}")  # the whole model, by name
        print("exported:", ", ".join(sorted(state)[:3]), "...")
    for step, loss in enumerate(reference()):
        print(f"local step {step}: loss {loss:.12f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
