"""The built-in GPT on sequence parts: its segments' carry gives part j + 1 exactly what the
whole sequence computes there, its data pads each batch to a multiple of the parts, and
Seq1F1B trains `tiny-gpt` as non-pipelined training of the whole sequences."""

from __future__ import annotations

import pytest
import torch

import schedcc
from schedcc.backends.reference import assert_matches_reference
from schedcc.backends.run import models
from schedcc.backends.run.gpt import (
    GPT,
    GPT_LOSS,
    IGNORE_INDEX,
    GPTConfig,
    PaddedBigramData,
    gpt_segments,
)
from schedcc.backends.runtime.tied import tied_groups
from schedcc.schedules.seq1f1b import Seq1F1B

TOLERANCE = 1e-10
CONFIG = GPTConfig(vocab=16, max_len=12, d_model=16, num_heads=2, num_blocks=3)


def _on_parts(segments, inputs, num_parts: int) -> torch.Tensor:
    """The logits of `segments` run part after part along the sequence, each segment called
    with its own carry of the part before (None for the first), as a schedule of parts does."""
    carries = [None] * len(segments)
    logits = []
    for part in zip(*(t.chunk(num_parts, dim=1) for t in inputs)):
        value = part
        for k, segment in enumerate(segments):
            value, carries[k] = segment(*value, carries[k])
        logits.append(value)
    return torch.cat(logits, dim=1)


def _loss_and_grads(model: GPT, logits: torch.Tensor, targets) -> tuple[float, list]:
    model.zero_grad()
    loss_sum, count = GPT_LOSS(logits, targets)
    loss = loss_sum / count
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("num_segments", [1, 3])
@pytest.mark.parametrize("num_parts", [2, 3, 4])
def test_the_gpt_on_parts_equals_the_whole_sequence(float64, num_parts, num_segments):
    """On padded variable-length rows cut into k parts (some rows ending in an earlier part),
    segments handing their carry on give the whole GPT's logits, loss and gradients (1e-10)."""
    data = PaddedBigramData(16, 12, min_len=1, seed=5, pad_to_multiple_of=num_parts)
    padding_only_parts = 0
    for step in range(4):
        (tokens, pad_mask), targets = data.batch(6, step)
        assert tokens.shape[1] % num_parts == 0
        last_part = pad_mask.chunk(num_parts, dim=1)[-1]
        padding_only_parts += int(last_part.all(dim=1).sum())
        model = GPT(CONFIG, seed=step)
        whole = model(tokens, pad_mask)
        loss, grads = _loss_and_grads(model, whole, targets)
        parts = _on_parts(gpt_segments(model, num_segments), (tokens, pad_mask), num_parts)
        parts_loss, parts_grads = _loss_and_grads(model, parts, targets)
        assert torch.allclose(parts, whole, rtol=0, atol=TOLERANCE)
        assert abs(parts_loss - loss) < TOLERANCE
        for got, want in zip(parts_grads, grads):
            assert torch.allclose(got, want, rtol=0, atol=TOLERANCE)
    assert padding_only_parts > 0  # a row's real tokens all in earlier parts


def test_a_batch_padded_past_max_len_keeps_its_position_ids_in_the_table(float64):
    """With k = 3 a batch of max_len = 32 tokens pads to 33 columns; the position ids count
    real tokens only, so the first segment embeds them with its max_len table, and the parts
    equal the whole sequence."""
    model = models.build("tiny-gpt", 2, parts=3)
    for step in range(50):
        (tokens, pad_mask), _ = model.batch(4, step)
        if tokens.shape[1] > 32:
            break
    assert tokens.shape[1] == 33, "no batch of max_len in 50 steps"
    first, last = model.segments
    assert int(first(tokens, pad_mask)[2].max()) <= 31
    whole = last(*first(tokens, pad_mask))
    parts = _on_parts(model.segments, (tokens, pad_mask), 3)
    assert torch.allclose(parts, whole, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("num_parts", [1, 2, 3, 4])
def test_padding_to_a_multiple_of_the_parts_only_adds_padding_columns(num_parts):
    """`tiny-gpt` built for k parts draws the batches it draws without parts, with padding
    columns appended up to a multiple of k (tokens 0, padding, targets ignored); for k = 1
    exactly the same tensors, and its loss is the unpadded batch's."""
    plain = models.build("tiny-gpt", 2)
    padded = models.build("tiny-gpt", 2, parts=num_parts)
    lengths = set()
    for step in range(6):
        (tokens, pad_mask), targets = plain.batch(4, step)
        (p_tokens, p_mask), p_targets = padded.batch(4, step)
        seq = tokens.shape[1]
        lengths.add(seq % num_parts)
        assert p_tokens.shape[1] == seq + (-seq % num_parts)
        assert torch.equal(p_tokens[:, :seq], tokens)
        assert torch.equal(p_mask[:, :seq], pad_mask)
        assert torch.equal(p_targets[:, :seq], targets)
        assert (p_tokens[:, seq:] == 0).all()
        assert p_mask[:, seq:].all()
        assert (p_targets[:, seq:] == IGNORE_INDEX).all()
        first, last = plain.segments
        loss = GPT_LOSS(last(*first(tokens, pad_mask)), targets)
        p_loss = GPT_LOSS(last(*first(p_tokens, p_mask)), p_targets)
        assert torch.allclose(p_loss[0], loss[0], rtol=1e-6, atol=0)
        assert int(p_loss[1]) == int(loss[1])
    if num_parts > 1:
        assert lengths != {0}  # some batch needed padding
    else:  # the held-out batches too
        for held_out in range(2):
            (tokens, pad_mask), targets = plain.eval_batch(4, held_out)
            (p_tokens, p_mask), p_targets = padded.eval_batch(4, held_out)
            assert torch.equal(p_tokens, tokens)
            assert torch.equal(p_mask, pad_mask)
            assert torch.equal(p_targets, targets)


@pytest.mark.parametrize(
    ("p", "m", "num_parts", "dp"), [(2, 4, 2, 1), (2, 8, 4, 1), (3, 6, 3, 1), (2, 4, 2, 2)]
)
def test_seq1f1b_trains_tiny_gpt_as_non_pipelined_training(float64, p, m, num_parts, dp):
    """Seq1F1B on the built-in tiny-gpt (tied head, padded batches of changing lengths, the
    carry on every segment) on the local engine equals non-pipelined training of the whole
    sequences, losses and weights (float64, 1e-10)."""
    model = models.build("tiny-gpt", p, parts=num_parts)
    size = m // num_parts * 2 * dp  # two samples a microbatch of the data
    batches = [model.batch(size, step) for step in range(3)]
    assert len({tokens.shape[1] for (tokens, _), _ in batches}) > 1
    program = schedcc.compile(
        Seq1F1B(p, m, num_parts=num_parts, num_batches=3),
        data_parallel=dp,
        tied=tied_groups(model.segments),
    )

    def adam(params):
        return torch.optim.Adam(params, lr=1e-2)

    assert_matches_reference(program, model.segments, model.loss_fn, adam, batches)



FACTORIES = """
import torch
from schedcc.backends.run.models import RunModel


def _model(num_segments, parts):  # the parts it was given, as its floor
    segments = [torch.nn.Identity() for _ in range(num_segments)]
    return RunModel(segments, lambda y, t: y, lambda b, s: None, floor=parts)


def with_parts(num_segments, *, seed, parts=1):
    return _model(num_segments, parts)


def without(num_segments, *, seed):
    return _model(num_segments, None)
"""


def test_a_factory_that_takes_parts_is_given_them(tmp_path):
    """`parts=` goes to any factory that takes it (the contract `builds_some` reads for
    `segments=`), only above one; a factory without it is called as before; of the
    built-ins, `tiny-gpt` takes it and `mlp` (no sequence) does not."""
    path = tmp_path / "factories.py"
    path.write_text(FACTORIES)
    assert models.build(f"{path}:with_parts", 2, parts=4).floor == 4
    assert models.build(f"{path}:with_parts", 2, parts=1).floor == 1  # its own default
    assert models.build(f"{path}:without", 2, parts=4).floor is None  # no TypeError
    assert models.takes_parts(models.BUILT_IN["tiny-gpt"])
    assert not models.takes_parts(models.BUILT_IN["mlp"])
