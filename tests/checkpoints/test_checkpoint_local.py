"""Local-backend checkpoints: an interrupted and resumed run equals the uninterrupted one."""

from __future__ import annotations

import pytest
import torch

import schedcc
from schedcc.backends.local import Engine
from schedcc.errors import CheckpointError

WIDTH = 6


def _engine(name, p, m, v=1, batches=1, dp=1, zero=0, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(p * v):
        layers += [torch.nn.Linear(WIDTH, WIDTH, dtype=torch.float64), torch.nn.Tanh()]
    segments = schedcc.partition(torch.nn.Sequential(*layers), p * v, method="uniform")
    schedule = schedcc.get_schedule(name)(p, m, num_chunks=v, num_batches=batches)
    program = schedcc.compile(schedule, data_parallel=dp, zero=zero)
    engine = Engine(
        program,
        segments,
        torch.nn.functional.mse_loss,
        lambda params: torch.optim.Adam(params, lr=0.01),
    )
    return engine, segments


def _data(n, size=8):
    gen = torch.Generator().manual_seed(123)
    return [
        (
            torch.randn(size, WIDTH, generator=gen, dtype=torch.float64),
            torch.randn(size, WIDTH, generator=gen, dtype=torch.float64),
        )
        for _ in range(n)
    ]


def _params(segments):
    return [p.detach().clone() for seg in segments for p in seg.parameters()]


CASES = [
    ("1f1b", {"p": 2, "m": 4}),
    ("interleaved-1f1b", {"p": 2, "m": 4, "v": 2}),
    ("2bw", {"p": 2, "m": 4, "batches": 2}),
    ("1f1b", {"p": 2, "m": 2, "dp": 2, "zero": 1}),
]


@pytest.mark.parametrize(("name", "shape"), CASES)
def test_resume_equals_uninterrupted_bit_for_bit(tmp_path, name, shape):
    """Train 4 batches, save, resume in a fresh engine, train 2 more: same bits as 6 in a row."""
    data = _data(6)
    whole, whole_segments = _engine(name, **shape)
    whole_losses = list(whole.train(data))

    first, _ = _engine(name, **shape)
    first_losses = list(first.train(data[:4]))
    first.save(tmp_path / "ckpt")

    resumed, resumed_segments = _engine(name, **shape, seed=99)  # other initial weights
    resumed.load(tmp_path / "ckpt")
    assert resumed.steps == 4
    resumed_losses = list(resumed.train(data[4:]))

    assert first_losses + resumed_losses == whole_losses
    for a, b in zip(_params(whole_segments), _params(resumed_segments), strict=True):
        assert torch.equal(a, b)


def test_elastic_resume_changes_data_parallel_and_zero(tmp_path):
    """A dp=2, ZeRO-1 checkpoint resumes at dp=1 without ZeRO (and back), Adam state re-sharded."""
    data = _data(4)
    whole, whole_segments = _engine("1f1b", 2, 2, dp=2, zero=1)
    list(whole.train(data))

    first, _ = _engine("1f1b", 2, 2, dp=2, zero=1)
    list(first.train(data[:2]))
    first.save(tmp_path / "a")
    single, _ = _engine("1f1b", 2, 2, dp=1, zero=0, seed=5)
    single.load(tmp_path / "a")
    single.save(tmp_path / "b")
    again, again_segments = _engine("1f1b", 2, 2, dp=2, zero=1, seed=7)
    again.load(tmp_path / "b")
    list(again.train(data[2:]))

    for a, b in zip(_params(whole_segments), _params(again_segments), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_other_schedule_loads_by_name(tmp_path):
    """A 1f1b checkpoint loads into a gpipe engine of the same model: its weights by name."""
    saved, saved_segments = _engine("1f1b", 2, 4)
    list(saved.train(_data(1)))
    saved.save(tmp_path / "c")
    other, segments = _engine("gpipe", 2, 4, seed=3)
    other.load(tmp_path / "c")
    assert all(torch.equal(a, b) for a, b in zip(_params(saved_segments), _params(segments)))
    assert other.steps == 1


def test_other_model_refused(tmp_path):
    """A checkpoint of a model with other parameter sizes is refused before loading anything."""
    saved, _ = _engine("1f1b", 2, 4)
    saved.save(tmp_path / "d")
    torch.manual_seed(0)
    wide = [torch.nn.Linear(WIDTH, 2 * WIDTH, dtype=torch.float64) for _ in range(2)]
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    other = Engine(program, wide, torch.nn.functional.mse_loss, torch.optim.SGD)
    with pytest.raises(CheckpointError, match="saved from another model"):
        other.load(tmp_path / "d")
