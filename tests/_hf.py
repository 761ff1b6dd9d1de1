"""Tiny Hugging Face models built from configs (no download), their batches and their loss.

Every family the HF tests cut: GPT-2 (head tied to the token embedding), Llama tied and untied,
BERT masked LM (decoder tied to the word embedding) and T5 (one embedding read by the encoder,
the decoder and the LM head). Dropout is off, so a forward is a function of its inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

__all__ = ["FAMILIES", "VOCAB", "batches", "build", "points", "token_loss"]

VOCAB = 64

#: name -> the (family, options) that `build` makes.
FAMILIES = ("gpt2", "llama-tied", "llama-untied", "bert", "t5")

_IDS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}


def build(name: str, *, seed: int = 0) -> torch.nn.Module:
    """The float64 model of family `name`, its weights a function of `seed`."""
    torch.manual_seed(seed)
    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=4, n_head=2, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, **_IDS,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    elif name.startswith("llama"):
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            tie_word_embeddings=name == "llama-tied", use_cache=False, **_IDS,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    elif name == "bert":
        config = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
            intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            max_position_embeddings=32, pad_token_id=0,
        )  # fmt: skip
        model = transformers.BertForMaskedLM(config)
    elif name == "t5":
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
            num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, use_cache=False, **_IDS,
        )  # fmt: skip
        model = transformers.T5ForConditionalGeneration(config)
    else:
        raise ValueError(f"no family {name!r}")
    return model.double()


def points(name: str, num_segments: int) -> list[str]:
    """Where to cut family `name` into 2 or 4 segments."""
    if name == "t5":  # 4: encoder block 1, decoder blocks 0 and 1 start segments 1..3
        four = ["encoder.block.1", "decoder.block.0", "decoder.block.1"]
        return {2: ["decoder.block.0"], 4: four}[num_segments]
    layers = {"gpt2": "transformer.h", "bert": "bert.encoder.layer"}.get(name, "model.layers")
    return {2: [f"{layers}.2"], 4: [f"{layers}.1", f"{layers}.2", f"{layers}.3"]}[num_segments]


def batches(name: str, num_batches: int, batch_size: int, *, length: int = 8, seed: int = 1):
    """`(BatchEncoding inputs, labels)` pairs: next tokens for the causal LMs, masked tokens
    (-100 elsewhere) for BERT, the target sequence for T5; padding in the attention masks."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_batches):
        tokens = torch.randint(2, VOCAB, (batch_size, length + 1), generator=gen)
        mask = torch.ones(batch_size, length, dtype=torch.long)
        mask[0, -2:] = 0  # the first sample is padded
        inputs = {"input_ids": tokens[:, :-1], "attention_mask": mask}
        labels = tokens[:, 1:]
        if name == "bert":
            masked = torch.rand(batch_size, length, generator=gen) < 0.3
            masked[:, 0] = True
            inputs["input_ids"] = tokens[:, :-1].masked_fill(masked, 2)
            labels = tokens[:, :-1].masked_fill(~masked, -100)
        elif name == "t5":
            labels = torch.randint(2, VOCAB, (batch_size, 6), generator=gen)
            start = torch.zeros_like(labels[:, :1])  # decoder_start_token_id
            inputs["decoder_input_ids"] = torch.cat([start, labels[:, :-1]], 1)
        out.append((transformers.BatchEncoding(inputs), labels))
    return out


def token_loss(output, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(summed cross entropy, counted tokens)` of a ModelOutput's logits (or of the logits)."""
    logits = output.logits if hasattr(output, "logits") else output
    total = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    return total, (labels != -100).sum()
