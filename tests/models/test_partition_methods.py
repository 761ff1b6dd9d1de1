"""schedcc.partition's methods: "parameters", "uniform" and "type:REGEX" cut where expected, and
training the cut model equals training the model whole (local engine, float64)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import schedcc
from schedcc.backends.local import Engine
from schedcc.backends.reference import train_reference
from schedcc.errors import ScheduleConfigError

WIDTH = 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Layer(Block):
    """Another block class, for a pattern with alternatives."""


class Embed(nn.Module):
    """A layer much larger than a block (so "parameters" and "type:" cut differently)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, 40 * WIDTH, dtype=torch.float64)
        self.down = nn.Linear(40 * WIDTH, WIDTH, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.linear(x))


def _model(seed: int = 0) -> nn.Sequential:
    """An embedding, six blocks and a head: 8 layers."""
    torch.manual_seed(seed)
    head = nn.Linear(WIDTH, 2, dtype=torch.float64)
    return nn.Sequential(Embed(), *(Block() for _ in range(6)), head)


def _starts(model, n, method) -> list[int]:
    """The layer index where each segment starts."""
    starts, total = [], 0
    for segment in schedcc.partition(model, n, method):
        starts.append(total)
        total += len(segment)
    return starts


@pytest.mark.parametrize(
    ("method", "n", "starts"),
    [
        ("parameters", 2, [0, 1]),  # the embedding outweighs the rest
        ("parameters", 3, [0, 1, 2]),  # the largest segment decides; the rest keep it
        ("uniform", 3, [0, 3, 6]),
        ("uniform", 4, [0, 2, 4, 6]),
        ("type:Block", 2, [0, 4]),  # 3 blocks each; the embedding and head ride along
        ("type:Block", 3, [0, 3, 5]),
        ("type:block", 6, [0, 2, 3, 4, 5, 6]),  # the case is ignored, as DeepSpeed does
        ("type:^Embed$", 1, [0]),
    ],
)
def test_each_method_cuts_where_expected(method, n, starts):
    assert _starts(_model(), n, method) == starts


def test_type_patterns_with_alternatives_count_every_class_they_match():
    """type:(Block|Layer) counts both classes; type:Block counts only its own, and a layer
    the pattern skips (the Layers here) rides with its neighbours like the embedding."""
    layers = [Embed(), Block(), Layer(), Layer(), Block(), Layer(), Block(), nn.Linear(6, 2)]
    assert _starts(layers, 3, "type:(Block|Layer)") == [0, 3, 5]
    assert _starts(layers, 3, "type:^Block") == [0, 2, 5]


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("type:Attention", "matches 0 layer(s), fewer than the 2 segments"),
        ("type:Embed", "matches 1 layer(s), fewer than the 2 segments"),
        ("type:(Block", "is not a regular expression"),
        ("types:Block", "'type:REGEX'"),
        ("Block", "unknown partition method"),
    ],
)
def test_bad_methods_say_what_to_use(method, message):
    with pytest.raises(ScheduleConfigError, match=re.escape(message)) as info:
        schedcc.partition(_model(), 2, method)
    assert isinstance(info.value, ValueError)
    if "matches" in message:  # the classes there are, to pick a pattern from
        assert "the layers' classes are Block, Embed, Linear" in str(info.value)


@pytest.mark.parametrize("method", ["parameters", "uniform", "type:Block"])
def test_training_the_cut_model_equals_training_it_whole(method):
    """Each cut, trained on the local engine under 1F1B, reaches the weights that plain training
    of the same model reaches (float64, to 1e-12)."""
    p, m = 2, 4
    model, reference = _model(), _model()
    gen = torch.Generator().manual_seed(3)
    batches = [
        (
            torch.randn(8, WIDTH, generator=gen, dtype=torch.float64),
            torch.randn(8, 2, generator=gen, dtype=torch.float64),
        )
        for _ in range(3)
    ]

    def sgd(params):
        return torch.optim.SGD(params, lr=0.05)

    loss_fn = nn.functional.mse_loss
    program = schedcc.compile(schedcc.get_schedule("1f1b")(p, m))
    engine = Engine(program, schedcc.partition(model, p, method), loss_fn, sgd)
    losses = list(engine.train(copy.deepcopy(batches)))
    expected = train_reference(list(reference), loss_fn, sgd, batches, num_microbatches=m)
    torch.testing.assert_close(losses, expected, rtol=0, atol=1e-12)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
