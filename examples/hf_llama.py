"""A Hugging Face Llama, unmodified, trained by `schedcc run`.

    pip install -e ".[hf]"
    schedcc run --model examples/hf_llama.py:make --steps 20
    schedcc run --model examples/hf_llama.py:make -p 4 --schedule interleaved-1f1b -v 2 --check
    schedcc run --model examples/hf_llama.py:make_mean --check   # per-microbatch means

`make(num_segments, *, seed)` builds a tiny `LlamaForCausalLM` from a `LlamaConfig` (nothing is
downloaded), cuts it with `schedcc.split` before evenly spaced decoder layers (torch.export, the
example batch telling it how the model is called) and returns it as a `RunModel`. Batches are
`BatchEncoding`s of right-padded sequences whose lengths vary within and across steps (a pure
function of the step); padded positions have the label -100. Each rank of the run builds the
whole (tiny) model and keeps its own segments; examples/char_lm.py shows a factory that builds
only a rank's own (`segments=`).

The loss is a `schedcc.TokenLoss`: summed cross entropy over the real tokens, divided by the
batch's count of them, which the engines read from the labels before the first backward. Llama's
RMSNorm computes in float32 even in a float64 model; dividing each microbatch's sum before its
backward, as non-pipelined training does, keeps `--check` within 1e-9. `make_mean` trains the
other objective, each microbatch's mean over its own real tokens, and the batch the mean of
those (gradient accumulation as most training loops do it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers

import schedcc
from schedcc.backends.run.models import RunModel

VOCAB = 32
MIN_LEN, MAX_LEN = 6, 16
IGNORE = -100


def model(num_layers: int, *, seed: int) -> transformers.LlamaForCausalLM:
    """A Llama of width 32 and `num_layers` decoder layers, its weights a function of `seed`."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN,
        use_cache=False, bos_token_id=0, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def batch(batch_size: int, step: int) -> tuple[transformers.BatchEncoding, torch.Tensor]:
    """`(BatchEncoding, labels)`: counting sequences (a random start and stride each), right
    padded to the step's longest; the labels are the next tokens, -100 past each sequence."""
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (batch_size,), generator=gen)
    longest = int(lengths.max())
    start = torch.randint(2, VOCAB, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
    tokens = 2 + (start + stride * torch.arange(longest + 1)) % (VOCAB - 2)
    real = torch.arange(longest) < lengths[:, None]
    input_ids = tokens[:, :-1].masked_fill(~real, 0)  # pad_token_id
    labels = tokens[:, 1:].masked_fill(~real, IGNORE)
    inputs = {"input_ids": input_ids, "attention_mask": real.long()}
    return transformers.BatchEncoding(inputs), labels


def summed_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the ModelOutput's logits, summed over the real tokens."""
    logits = output.logits.flatten(0, 1)
    return F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE, reduction="sum")


def real_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many labels are not padding."""
    return (labels != IGNORE).sum()


def mean_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the ModelOutput's logits, the mean over the microbatch's real tokens."""
    return summed_loss(output, labels) / real_tokens(labels)


def make(num_segments: int, *, seed: int, loss_fn=None) -> RunModel:
    """The Llama cut into `num_segments` segments, trained on the real tokens' mean over the
    whole batch (a `TokenLoss`)."""
    llama = model(max(2, num_segments), seed=seed)
    layers = len(llama.model.layers)
    points = [f"model.layers.{k * layers // num_segments}" for k in range(1, num_segments)]
    example, _ = batch(2, 0)
    segments = schedcc.split(llama, points, example_inputs=example)
    return RunModel(
        segments,
        loss_fn or schedcc.TokenLoss(summed_loss, real_tokens),
        batch,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        count=lambda inputs, labels: int(real_tokens(labels)),
        unit="tokens",
    )


def make_mean(num_segments: int, *, seed: int) -> RunModel:
    """As `make`, trained on each microbatch's mean over its real tokens."""
    return make(num_segments, seed=seed, loss_fn=mean_loss)
