"""A Hugging Face GPT-2, unmodified, trained as a 2-stage 1F1B pipeline on the local engine.

    pip install -e ".[hf]"
    python examples/train_hf_gpt2.py --steps 20

The model is built from a small config (nothing is downloaded). `schedcc.split` cuts it before
`transformer.h.2` with `torch.export`, the example batch telling it how the model is called; the
LM head is tied to the token embedding, so both segments hold that one Parameter and
`schedcc.tied_groups` gives the `tied=` to compile with. Batches are `BatchEncoding`s, as a
tokenizer returns them, and the loss reads the `logits` of the `ModelOutput` the last segment
returns. The data: each sequence counts up by a random step modulo the vocabulary, so the
next token is learnable from the two before it.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import transformers

import schedcc
from schedcc.backends.local import Engine

VOCAB = 32


def model(seed: int = 0) -> transformers.GPT2LMHeadModel:
    """A 4-block GPT-2 of width 32, dropout off."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=4, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def batch(step: int, size: int = 8, length: int = 16):
    """`(BatchEncoding, next tokens)`: counting sequences, each with its own start and stride."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    stride = torch.randint(1, 4, (size, 1), generator=gen)
    tokens = (start + stride * torch.arange(length + 1)) % VOCAB
    mask = torch.ones(size, length, dtype=torch.long)
    inputs = {"input_ids": tokens[:, :-1], "attention_mask": mask}
    return transformers.BatchEncoding(inputs), tokens[:, 1:]


def loss_fn(output, labels):
    """Mean next-token cross entropy of the ModelOutput's logits."""
    return F.cross_entropy(output.logits.flatten(0, 1), labels.flatten())


def main(steps: int = 10) -> list[float]:
    """Train for `steps` optimizer steps; print and return each step's loss."""
    gpt2 = model()
    example, _ = batch(0, size=2)
    segments = schedcc.split(gpt2, ["transformer.h.2"], example_inputs=example)
    tied = schedcc.tied_groups(segments)  # [(0, 1)]: the embedding is the head
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4), tied=tied)
    engine = Engine(program, segments, loss_fn, lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    losses = []
    for step, loss in enumerate(engine.train(batch(step) for step in range(steps))):
        print(f"step {step}: loss {loss:.4f}")
        losses.append(loss)
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    main(parser.parse_args().steps)
