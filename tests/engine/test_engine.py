"""One Engine contract (`backends.engine.BaseEngine`): both engines check their arguments, split
batches, count steps and refuse bad input alike, with the same error type and message.

The local engine is checked in this process; the distributed one on 2 gloo ranks, each comparing
every refusal with the local engine's for the same call.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _models import batches, make_segments, mse, sgd

import schedcc
from schedcc.backends.checkpoint.files import MANIFEST
from schedcc.backends.distributed import Engine as DistributedEngine
from schedcc.backends.engine import BaseEngine
from schedcc.backends.local import Engine as LocalEngine
from schedcc.backends.run.launch import spawn
from schedcc.errors import ScheduleConfigError


def _program(name: str = "1f1b", m: int = 4, num_batches: int = 1):
    return schedcc.compile(schedcc.get_schedule(name)(2, m, num_batches=num_batches))


def _bad_calls(x: torch.Tensor, y: torch.Tensor):
    """(what, call) on an engine over 1f1b p=2 m=4 that every engine refuses, and the message."""
    return [
        ("uneven", lambda e: e.train_step(x[:6], y[:6]), "batch 0: 6 samples cannot be split"),
        ("targets", lambda e: e.train_step(x, y[:4]), "targets must have the same batch size"),
        ("scalar", lambda e: e.train_step(x, y.sum()), "targets must be a tensor with a batch"),
        ("not a pair", lambda e: list(e.train([x])), r"batch 0 must be \(inputs, targets\)"),
        ("later", lambda e: list(e.train([(x, y), (x[:6], y[:6])])), "batch 1: 6 samples"),
    ]


def _bad_engines(engine, program, segments):
    """(what, make) for engines every backend refuses to build, and the message."""
    optimizer = torch.optim.SGD(segments[0].parameters(), lr=0.1)
    return [
        ("a schedule", lambda: engine(program.schedule, segments, mse, sgd), "a compiled Program"),
        ("an optimizer", lambda: engine(program, segments, mse, optimizer), "optimizer must be a"),
        ("a string loss", lambda: engine(program, segments, "mse", sgd), "loss_fn must be a"),
        ("a string segment", lambda: engine(program, [segments[0], "x"], mse, sgd), "segment 1 is"),
        ("three segments", lambda: engine(program, segments * 3, mse, sgd), r"p\*v = 2\*1 = 2 seg"),
    ]


def _bad_programs(engine, segments, x, y):
    """(what, call) refused for the program's sake, whatever the batches, and the message."""
    data = [(x, y)] * 3

    def run(name, num_batches, call):
        return lambda: call(engine(_program(name, 2, num_batches), segments, mse, sgd))

    return [
        ("short group", run("gpipe", 2, lambda e: list(e.train(data))), "multiple of 2 batches"),
        ("2bw step", run("2bw", 2, lambda e: e.train_step(x, y)), "train_step runs one flush"),
        ("2bw, one batch", run("2bw", 1, lambda e: e.train_step(x, y)), "weight_delay=1"),
    ]


def test_both_engines_keep_one_contract():
    """Both engines are `BaseEngine`s: train, train_step, save, load and peak_activation_bytes
    are called the same way on each."""
    assert issubclass(LocalEngine, BaseEngine)
    assert issubclass(DistributedEngine, BaseEngine)
    for name in ("train", "train_step", "save", "load"):
        local, distributed = getattr(LocalEngine, name), getattr(DistributedEngine, name)
        assert inspect.signature(local) == inspect.signature(distributed), name
    assert LocalEngine.peak_activation_bytes is DistributedEngine.peak_activation_bytes


@pytest.mark.parametrize("case", range(5))
def test_the_local_engine_refuses_bad_batches(case):
    """Each bad batch is a ScheduleConfigError naming it and the rule it breaks."""
    x, y = batches(1, 8)[0]
    _, call, message = _bad_calls(x, y)[case]
    segments = make_segments(2)
    engine = LocalEngine(_program(), segments, mse, sgd)
    with pytest.raises(ScheduleConfigError, match=message):
        call(engine)


@pytest.mark.parametrize("case", range(5))
def test_the_local_engine_refuses_bad_arguments(case):
    """A schedule for a program, an optimizer instance for a factory, a loss or segment that is
    not callable or not a module, the wrong count: a ScheduleConfigError naming it."""
    segments = make_segments(2)
    _, make, message = _bad_engines(LocalEngine, _program(), segments)[case]
    with pytest.raises(ScheduleConfigError, match=message):
        make()


@pytest.mark.parametrize("case", range(3))
def test_the_local_engine_refuses_what_the_program_cannot_do(case):
    """A short last group of batches, and train_step on a weight-delayed schedule (whatever
    num_batches: a one-batch run would silently train without the delay)."""
    x, y = batches(1, 2)[0]
    _, call, message = _bad_programs(LocalEngine, make_segments(2), x, y)[case]
    with pytest.raises(ScheduleConfigError, match=message):
        call()


def test_steps_count_every_optimizer_step_of_a_run():
    """A run of a two-batch program takes both steps, even if only its first loss is read."""
    engine = LocalEngine(_program("gpipe", 2, num_batches=2), make_segments(2), mse, sgd)
    next(engine.train(batches(2, 4)))
    assert engine.steps == 2
    engine = LocalEngine(_program(), make_segments(2), mse, sgd)
    engine.train_step(*batches(1, 8)[0])
    assert engine.steps == 1


def test_the_local_engine_reports_peak_activation_bytes_per_stage():
    """Every stage of the local engine has a measured peak (none is None)."""
    engine = LocalEngine(_program(), make_segments(2), mse, sgd)
    engine.train_step(*batches(1, 8)[0])
    peaks = engine.peak_activation_bytes
    assert len(peaks) == 2
    assert all(isinstance(peak, int) and peak > 0 for peak in peaks)


# -- the distributed engine, against the local one ----------------------------------------------


def _refusal(call, *args) -> tuple[type, str]:
    """The type and message of what `call(*args)` raises."""
    try:
        call(*args)
    except Exception as error:
        return type(error), str(error)
    raise AssertionError("not refused")


def _contract_worker(rank: int, world_size: int, directory: str) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    x, y = batches(1, 8)[0]
    segments = make_segments(2)
    for (what, make, _), (_, local_make, _) in zip(
        _bad_engines(DistributedEngine, _program(), segments),
        _bad_engines(LocalEngine, _program(), segments),
    ):
        got, want = _refusal(make), _refusal(local_make)
        assert got[0] is want[0] is ScheduleConfigError, (what, got, want)
        if what == "three segments":  # the distributed one also takes this stage's segments
            assert "or this stage's 1 by chunk" in got[1], got
        else:
            assert got == want, what
    for (what, call, _), (_, local_call, _) in zip(
        _bad_programs(DistributedEngine, segments, x[:2], y[:2]),
        _bad_programs(LocalEngine, segments, x[:2], y[:2]),
    ):
        assert _refusal(call) == _refusal(local_call), what
    program = _program()
    mine, oracle = make_segments(2, seed=5), make_segments(2, seed=5)
    engine = DistributedEngine(program, mine, mse, sgd, timeout=30)
    local = LocalEngine(program, oracle, mse, sgd)
    for what, call, _ in _bad_calls(x, y):
        got, want = _refusal(call, engine), _refusal(call, local)
        assert got == want, (what, got, want)
        assert got[0] is ScheduleConfigError, (what, got)
    data = batches(2, 8, seed=3)
    assert list(engine.train(data)) == pytest.approx(list(local.train(data)), abs=1e-12)
    assert engine.steps == local.steps == 3  # the "later" case trained its first batch on both
    for got, want in zip(mine[rank].parameters(), oracle[rank].parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    peaks = engine.peak_activation_bytes
    assert peaks[rank] == local.peak_activation_bytes[rank] > 0, (peaks, rank)
    assert peaks[1 - rank] is None, peaks
    assert engine.save(Path(directory) / "d") == Path(directory) / "d" / MANIFEST
    assert local.save(Path(directory) / f"l{rank}") == Path(directory) / f"l{rank}" / MANIFEST
    dist.destroy_process_group()
    return 0


def test_the_distributed_engine_refuses_and_trains_as_the_local_one(tmp_path):
    """On 2 gloo ranks every refusal above has the local engine's type and message, on every
    rank; then both train to the same numbers, count the same steps, report this stage's peak
    activation bytes and return the manifest's path from save."""
    assert spawn(_contract_worker, 2, (str(tmp_path),), grace=20, threads=1) == 0
    assert (tmp_path / "d" / MANIFEST).exists()
