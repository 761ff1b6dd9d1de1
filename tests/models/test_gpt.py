"""The real small GPT: padding, position ids, the tied head, hand segments and `schedcc.split`."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

import schedcc
from schedcc.backends.run.gpt import (
    GPT,
    IGNORE_INDEX,
    GPTConfig,
    PaddedBigramData,
    gpt_segments,
    mean_token_loss,
    token_loss,
)
from schedcc.backends.runtime.values import call, flatten, grad_tensors, tensor_meta, unflatten
from schedcc.errors import ScheduleConfigError

CONFIG = GPTConfig(vocab=16, max_len=12, d_model=16, num_heads=2, num_blocks=6)


def _model(seed: int = 0) -> GPT:
    return GPT(CONFIG, seed=seed).double()


def _batch(step: int, batch_size: int = 4):
    return PaddedBigramData(CONFIG.vocab, CONFIG.max_len, seed=3).batch(batch_size, step)


def chain(segments, inputs):
    """The segments run one after the other, each called on what the previous returned."""
    value = inputs
    for segment in segments:
        value = call(segment, value)
    return value


def pipelined_grads(segments, inputs, targets):
    """Forward and backward as a pipeline does: each boundary flattened, detached and rebuilt,
    gradients sent back only for the tensors `grad_tensors` picks; returns the loss."""
    value, boundaries = inputs, []
    for segment in segments[:-1]:
        sent, spec = flatten(call(segment, value))
        meta = tensor_meta(sent)
        received = [t.detach().requires_grad_(m.requires_grad) for t, m in zip(sent, meta)]
        boundaries.append((grad_tensors(sent), [r for r in received if r.requires_grad]))
        value = unflatten(received, spec)
    loss_sum, count = token_loss(call(segments[-1], value), targets)
    loss = loss_sum / count
    loss.backward()
    for sent, received in reversed(boundaries):
        torch.autograd.backward(sent, [r.grad for r in received])
    return loss


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_the_head_is_tied_to_the_token_embedding():
    """`head.weight` is the token embedding's Parameter, counted once among the parameters."""
    model = _model()
    assert model.head.weight is model.tok.weight
    assert sum(p is model.tok.weight for p in model.parameters()) == 1


@pytest.mark.parametrize("num_segments", [1, 2, 3, 6])
def test_hand_segments_chain_to_the_model_exactly(num_segments):
    """The hand-cut segments, chained with the calling convention, are the model (float64)."""
    model = _model()
    segments = gpt_segments(model, num_segments)
    assert segments[0].tok.weight is segments[-1].head.weight
    for step in range(3):
        inputs, _ = _batch(step)
        assert torch.equal(chain(segments, inputs), model(*inputs))


@pytest.mark.parametrize("cut", ["hand", "split"])
def test_pipelined_backward_equals_the_models(cut):
    """Through detached tuple boundaries (x, pad_mask, pos_ids), the loss and every gradient,
    the tied one included, equal the whole model's."""
    model, reference = _model(), _model()
    if cut == "hand":
        segments = gpt_segments(model, 3)
    else:
        segments = schedcc.split(model, ["blocks.2", "blocks.4"])
    for step in range(3):  # three sequence lengths
        inputs, targets = _batch(step)
        model.zero_grad()
        reference.zero_grad()
        loss = pipelined_grads(segments, inputs, targets)
        expected = mean_token_loss(reference(*inputs), targets)
        expected.backward()
        assert torch.equal(loss, expected)
        grads, want = _grads(model), _grads(reference)
        assert [name for name in want if not torch.equal(grads[name], want[name])] == []


def test_split_shares_the_tied_parameter_between_first_and_last():
    """`schedcc.split` keeps the tie: segment 0's `tok.weight` is the last one's `head.weight`."""
    model = _model()
    segments = schedcc.split(model, ["blocks.2", "blocks.4"])
    assert segments[0].tok.weight is segments[-1].head.weight is model.tok.weight
    inputs, _ = _batch(0)
    boundary = call(segments[0], inputs)
    dtypes = [t.dtype for t in flatten(boundary)[0]]
    assert sorted(map(str, dtypes)) == ["torch.bool", "torch.float64", "torch.int64"]
    for step in range(3):
        inputs, _ = _batch(step)
        assert torch.equal(chain(segments, inputs), model(*inputs))


def test_padding_does_not_change_the_real_positions():
    """A sequence's logits are the same alone as padded inside a longer batch (1e-12)."""
    model = _model()
    (tokens, pad_mask), _ = _batch(1, batch_size=6)
    logits = model(tokens, pad_mask)
    for row in range(tokens.shape[0]):
        length = int((~pad_mask[row]).sum())
        alone = model(tokens[row : row + 1, :length], pad_mask[row : row + 1, :length])
        torch.testing.assert_close(logits[row, :length], alone[0], rtol=0, atol=1e-12)


def test_attention_is_causal():
    """Changing a later token leaves every earlier position's logits unchanged."""
    model = _model()
    tokens = torch.randint(CONFIG.vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    pad_mask = torch.zeros(2, 8, dtype=torch.bool)
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % CONFIG.vocab
    before, after = model(tokens, pad_mask), model(changed, pad_mask)
    assert torch.equal(before[:, :5], after[:, :5])
    assert not torch.equal(before[:, 5:], after[:, 5:])


def test_dropout_is_off_by_default():
    """Two forwards in training mode give the same logits."""
    model = _model().train()
    inputs, _ = _batch(0)
    assert torch.equal(model(*inputs), model(*inputs))


def test_data_is_seeded_variable_length_and_padded_right():
    """Batches are pure functions of the step, change length, and mark padding consistently."""
    data = PaddedBigramData(CONFIG.vocab, CONFIG.max_len, min_len=2, seed=3)
    (tokens, pad_mask), targets = data.batch(8, step=5)
    (tokens2, _), targets2 = data.batch(8, step=5)
    assert torch.equal(tokens, tokens2)
    assert torch.equal(targets, targets2)
    assert (tokens.dtype, pad_mask.dtype, targets.dtype) == (torch.int64, torch.bool, torch.int64)
    assert torch.equal(targets == IGNORE_INDEX, pad_mask)
    assert torch.equal(tokens[pad_mask], torch.zeros_like(tokens[pad_mask]))
    lengths = (~pad_mask).sum(dim=1)
    assert int(lengths.min()) >= 2
    assert int(lengths.max()) == tokens.shape[1]
    assert torch.equal(pad_mask, pad_mask.cummax(dim=1).values)  # padding only on the right
    assert torch.equal(tokens[:, 1:][~pad_mask[:, 1:]], targets[:, :-1][~pad_mask[:, 1:]])
    widths = {data.batch(4, step)[0][0].shape[1] for step in range(10)}
    assert len(widths) > 1


def test_token_loss_ignores_padding_and_sums_exactly():
    """The loss counts real targets only; sums over microbatches divided by the whole count give
    the batch's mean whatever each microbatch's length."""
    model = _model()
    (tokens, pad_mask), targets = _batch(2, batch_size=4)
    logits = model(tokens, pad_mask)
    real = ~pad_mask
    expected = F.cross_entropy(logits[real], targets[real])
    torch.testing.assert_close(mean_token_loss(logits, targets), expected, rtol=0, atol=1e-14)
    parts = [token_loss(logits[i : i + 2], targets[i : i + 2]) for i in (0, 2)]
    total = sum(s for s, _ in parts) / sum(c for _, c in parts)
    torch.testing.assert_close(total, expected, rtol=0, atol=1e-14)
    assert int(token_loss(logits, targets)[1]) == int(real.sum())


def test_too_many_segments_are_refused():
    """More segments than blocks is a typed error that says what to change."""
    with pytest.raises(ScheduleConfigError, match="every segment needs at least one block"):
        gpt_segments(_model(), 7)


def test_partition_points_a_gpt_to_split():
    """`schedcc.partition` on a GPT says to use `schedcc.split` with points that fit it."""
    with pytest.raises(ScheduleConfigError, match=r"split\(model, \['blocks\.3'\], example"):
        schedcc.partition(_model(), 2)


def test_split_segments_pickle_together_with_their_tie():
    """Split segments pickled together (as for spawned ranks) keep the tie and compute the same."""
    model = _model()
    segments = pickle.loads(pickle.dumps(schedcc.split(model, ["blocks.3"])))
    assert segments[0].tok.weight is segments[1].head.weight
    assert segments[0].tok.weight is not model.tok.weight
    inputs, _ = _batch(1)
    assert torch.equal(chain(segments, inputs), model(*inputs))
