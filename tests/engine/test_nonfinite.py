"""Non-finite steps: a batch whose gradient holds inf or NaN on any stage or replica is skipped
by every stage alike, and training goes on as if it never came."""

from __future__ import annotations

import copy

import pytest
import torch
from _models import batches, make_segments, mse

import schedcc
from schedcc.backends.local import Engine


def _adam(params):
    return torch.optim.Adam(params, lr=0.05)


def _poisoned(batch, replica_rows):
    """`batch` with an inf in the inputs of the given rows (one replica's, say)."""
    inputs, targets = batch
    inputs = inputs.clone()
    inputs[replica_rows, 0] = float("inf")
    return inputs, targets


def _state(engine):
    """Every stage's weights and optimizer state, cloned."""
    out = []
    with engine.unsharded():  # ZeRO-3: the weights whole, not the empty placeholders
        for runtimes in engine.runtimes:
            for rt in runtimes:
                out.append([p.detach().clone() for mod in rt.modules for p in mod.parameters()])
                state = rt.optimizer.state_dict()["state"] if rt.optimizer is not None else {}
                out.append(
                    [v.clone() for s in state.values() for v in s.values() if torch.is_tensor(v)]
                )
    assert all(t.numel() for t in out[0])
    return out


@pytest.mark.parametrize(
    ("name", "p", "v", "dp", "zero"),
    [
        ("1f1b", 3, 1, 1, 0),
        ("interleaved-1f1b", 2, 2, 2, 0),
        ("1f1b", 2, 1, 2, 1),
        ("1f1b", 2, 1, 2, 2),
        ("1f1b", 2, 1, 2, 3),
    ],
)
def test_a_batch_with_an_inf_is_skipped_everywhere_and_training_goes_on(name, p, v, dp, zero):
    """The inf sits in one replica's rows only: no weight or optimizer state changes on any
    stage or replica, skipped_steps == 1, and the next batches train exactly as without it."""
    schedule = schedcc.get_schedule(name)(p, 4, v)
    program = schedcc.compile(schedule, data_parallel=dp, zero=zero, grad_norm=True)
    segments = make_segments(p * v)
    copied = copy.deepcopy(segments)  # before ZeRO-3 keeps only shards in the modules
    skipping, clean = Engine(program, segments, mse, _adam), Engine(program, copied, mse, _adam)
    good = batches(3, 8)
    bad = _poisoned(batches(1, 8, seed=9)[0], [0])
    list(skipping.train(good[:1]))
    list(clean.train(good[:1]))
    before = _state(skipping)
    list(skipping.train([bad]))  # tanh(inf) = 1: the loss is finite, the gradient is not
    assert skipping.skipped_steps == 1
    assert not torch.isfinite(torch.tensor(skipping.last_grad_norm))
    for got, want in zip(_state(skipping), before):
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert list(skipping.train(good[1:])) == list(clean.train(good[1:]))
    for got, want in zip(_state(skipping), _state(clean)):
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert skipping.skipped_steps == 1
    assert clean.skipped_steps == 0


def test_without_the_norm_a_non_finite_step_is_taken():
    """A program without GradNorm has no all-stage agreement: the step is taken (weights turn
    NaN), which is why grad_norm=True is what skipping needs."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    engine = Engine(program, make_segments(2), mse, _adam)
    list(engine.train([_poisoned(batches(1, 8)[0], [0])]))
    assert engine.skipped_steps == 0
    assert not all(torch.isfinite(p).all() for s in engine.segments for p in s.parameters())
