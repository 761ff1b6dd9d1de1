"""The per-step metrics stream: `train(..., on_step=)` records, JSONL and TensorBoard writers,
one writing rank, no extra host sync, and `schedcc run --metrics`."""

from __future__ import annotations

import copy
import json
import math
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _cli import run_cli
from _models import linear_segments, tanh_batches
from torch import nn

import schedcc
from schedcc.backends.distributed.engine import Engine as DistEngine
from schedcc.backends.local import Engine
from schedcc.backends.metrics import (
    JsonlWriter,
    TensorBoardWriter,
    open_metrics,
    step_records,
    tensorboard_available,
)
from schedcc.backends.reference import train_reference
from schedcc.backends.run.launch import spawn
from schedcc.backends.runtime.syncs import HostSyncs
from schedcc.errors import ScheduleConfigError

WIDTH = 4


def _segments(n: int, seed: int = 0) -> list[nn.Module]:
    return linear_segments(n, width=WIDTH, seed=seed)


def _batches(count: int, size: int = 8, seed: int = 1) -> list:
    return tanh_batches(count, size, width=WIDTH, seed=seed)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.2)


def _halving(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def _parts(output, target):
    """A dict loss: the objective and a named part."""
    mse = F.mse_loss(output, target)
    return {"loss": mse + 0.1 * output.abs().mean(), "mse": mse}


def _read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_jsonl_has_one_record_per_step_with_the_losses_train_returned(tmp_path):
    """1F1B with a dict loss, a halving learning rate and the gradient norm: each step's record
    holds the loss train yielded, its named parts, the rate the step used, the norm the
    non-pipelined loop measures and the skipped count."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4), grad_norm=True)
    segments, oracle = _segments(2), _segments(2)
    engine = Engine(program, segments, _parts, _sgd, lr_scheduler=_halving)
    path = tmp_path / "run.jsonl"
    norms: list[float] = []
    parts = []
    with JsonlWriter(path) as writer:
        losses = []
        for loss in engine.train(_batches(4), on_step=writer):
            losses.append(loss)
            parts.append(dict(engine.last_metrics))
            norms.append(engine.last_grad_norm)
    records = _read(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["loss"] for r in records] == losses
    assert [r["parts"] for r in records] == parts
    assert set(parts[0]) == {"loss", "mse"}
    assert [r["lr"] for r in records] == [0.2, 0.1, 0.05, 0.025]
    assert [r["grad_norm"] for r in records] == norms
    assert all(r["skipped_steps"] == 0 and r["loss_scale"] is None for r in records)
    assert all(r["time_s"] > 0 for r in records)
    expected_norms: list[float] = []
    expected = train_reference(
        oracle,
        _parts,
        _sgd,
        _batches(4),
        num_microbatches=4,
        lr_scheduler=_halving,
        grad_norms=expected_norms,
    )
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12
    assert max(abs(a - b) for a, b in zip(norms, expected_norms)) < 1e-12


def test_train_step_records_its_step_and_a_jsonl_writer_appends(tmp_path):
    program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 2))
    engine = Engine(program, _segments(2), F.mse_loss, _sgd)
    path = tmp_path / "run.jsonl"
    with JsonlWriter(path) as writer:
        first = engine.train_step(*_batches(1)[0], on_step=writer)
    with open_metrics(str(path), append=True) as writer:
        second = engine.train_step(*_batches(1, seed=2)[0], on_step=writer)
    records = _read(path)
    assert [(r["step"], r["loss"]) for r in records] == [(1, first), (2, second)]
    assert records[0]["parts"] == {"loss": first}
    assert records[0]["grad_norm"] is None


def test_a_run_of_several_steps_gives_the_rate_first_and_the_norm_last():
    """Under 2BW (4 batches a run) the rate is read before each run and the norm after it."""
    schedule = schedcc.get_schedule("2bw")(2, 2, num_batches=4)
    program = schedcc.compile(schedule, grad_norm=True)
    engine = Engine(program, _segments(2), F.mse_loss, _sgd, lr_scheduler=_halving)
    records: list[dict] = []
    losses = list(engine.train(_batches(8), on_step=records.append))
    assert [r["loss"] for r in records] == losses
    assert [r["lr"] for r in records] == [0.2, None, None, None, 0.2 / 16, None, None, None]
    assert [r["grad_norm"] is not None for r in records] == [False, False, False, True] * 2
    assert records[-1]["grad_norm"] == engine.last_grad_norm


def test_a_skipped_float16_step_is_recorded_with_the_halved_scale():
    """float16 with a loss scale so large the gradients overflow: the first record counts the
    skipped step, its scale is the halved one, and a step at a scale that fits trains."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2), grad_norm=True)
    segments = [s.float() for s in _segments(2)]
    engine = Engine(program, segments, F.mse_loss, _sgd, mixed_precision=torch.float16)
    for rt in engine.runtimes[0]:
        rt.norm.scaler.scale = 2.0**100
    records: list[dict] = []
    data = [(x.float(), y.float()) for x, y in _batches(2)]
    list(engine.train(data[:1], on_step=records.append))
    for rt in engine.runtimes[0]:
        rt.norm.scaler.scale = 2.0**8
    list(engine.train(data[1:], on_step=records.append))
    assert [r["skipped_steps"] for r in records] == [1, 1]
    assert [r["loss_scale"] for r in records] == [2.0**99, 2.0**8]
    assert math.isnan(records[0]["grad_norm"]) or math.isinf(records[0]["grad_norm"])
    assert math.isfinite(records[1]["grad_norm"])


@pytest.mark.parametrize("zero", [1, 3])
def test_under_zero_the_rate_is_the_shard_optimizers(zero):
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2), data_parallel=2, zero=zero)
    engine = Engine(program, _segments(2), F.mse_loss, _sgd, lr_scheduler=_halving)
    records: list[dict] = []
    losses = list(engine.train(_batches(3), on_step=records.append))
    assert [(r["loss"], r["lr"]) for r in records] == list(zip(losses, [0.2, 0.1, 0.05]))


def test_recording_adds_no_host_sync():
    """The same training reads the device as often with `on_step` as without."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2), grad_norm=True)
    counts = []
    for on_step in (None, [].append):
        engine = Engine(program, _segments(2), F.mse_loss, _sgd)
        before = HostSyncs.count
        list(engine.train(_batches(3), on_step=on_step))
        counts.append(HostSyncs.count - before)
    assert counts[0] == counts[1] > 0


def test_step_records_keep_a_nan_loss_and_jsonl_reads_it_back(tmp_path):
    (record,) = step_records(
        [(math.nan, {})],
        first_step=4,
        seconds=0.5,
        lr=None,
        grad_norm=None,
        loss_scale=None,
        skipped_steps=0,
    )
    with JsonlWriter(tmp_path / "m.jsonl") as writer:
        writer(record)
    (back,) = _read(tmp_path / "m.jsonl")
    assert back["step"] == 5
    assert math.isnan(back["loss"])
    assert back["time_s"] == 0.5


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "needs a file name"),
        ("tb:", "needs a log directory"),
        ("{tmp}", "is a directory"),
        ("{tmp}/missing/run.jsonl", "cannot write it"),
    ],
)
def test_open_metrics_refuses_what_it_cannot_write(tmp_path, spec, message):
    with pytest.raises(ScheduleConfigError, match=message):
        open_metrics(spec.format(tmp=tmp_path))


@pytest.mark.skipif(not tensorboard_available(), reason="the tensorboard package is missing")
def test_tensorboard_gets_one_scalar_per_number(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    engine = Engine(program, _segments(2), _parts, _sgd)
    with open_metrics(f"tb:{tmp_path}") as writer:
        assert isinstance(writer, TensorBoardWriter)
        losses = list(engine.train(_batches(3), on_step=writer))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"train/loss", "train/parts/mse", "train/lr", "train/time_s"} <= set(scalars)
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [s for s, _ in logged] == [1, 2, 3]
    assert max(abs(v - loss) for (_, v), loss in zip(logged, losses)) < 1e-6  # float32 there


@pytest.mark.skipif(tensorboard_available(), reason="the tensorboard package is installed")
def test_tensorboard_without_the_package_says_how_to_get_it(tmp_path):
    with pytest.raises(ScheduleConfigError, match="pip install tensorboard"):
        open_metrics(f"tb:{tmp_path}")


# -- on gloo ranks ------------------------------------------------------------------------------


def _gloo_worker(rank: int, world_size: int, root: str) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    segments = _segments(2)
    oracle = copy.deepcopy(segments)
    engine = DistEngine(program, segments, F.mse_loss, _sgd, timeout=20, lr_scheduler=_halving)
    path = f"{root}/rank{rank}.jsonl"
    with JsonlWriter(path) as writer:
        losses = list(engine.train(_batches(3), on_step=writer))
    records = _read(Path(path))
    assert engine.writes_metrics == (rank == 0)
    if rank == 0:  # stage 0, which knows the loss (reduced), writes; the last stage does not
        assert [r["loss"] for r in records] == losses
        assert [r["lr"] for r in records] == [0.2, 0.1, 0.05]
        expected = train_reference(
            oracle, F.mse_loss, _sgd, _batches(3), num_microbatches=2, lr_scheduler=_halving
        )
        assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12
    else:
        assert records == []
    dist.destroy_process_group()
    return 0


def test_on_gloo_ranks_only_rank_0_writes(tmp_path):
    """1F1B on 2 gloo ranks, each handed a writer: rank 0's file has every step's record with
    the losses its engine returned, rank 1's stays empty."""
    assert spawn(_gloo_worker, 2, (str(tmp_path),), grace=30, threads=1) == 0


# -- schedcc run --metrics ----------------------------------------------------------------------


def test_schedcc_run_writes_the_metrics_stream(tmp_path):
    """`schedcc run --metrics run.jsonl`: one record per step, each with the samples its global
    batch holds and the default optimizer's rate."""
    path = tmp_path / "run.jsonl"
    args = ("--model", "mlp", "-p", "2", "-m", "2", "--microbatch-size", "4", "--steps", "3")
    result = run_cli(*args, "--lr", "0.01", "--metrics", str(path))
    assert result.returncode == 0, result.stderr
    records = _read(path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["samples"] == 8 and r["lr"] == 0.01 for r in records), records
    assert all(math.isfinite(r["loss"]) and r["time_s"] > 0 for r in records), records


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{tmp}", "is a directory"),
        ("{tmp}/missing/run.jsonl", "does not exist"),
        ("tb:", "needs a log directory"),
    ],
)
def test_schedcc_run_refuses_a_bad_metrics_path_in_one_line(tmp_path, spec, message):
    result = run_cli("--steps", "1", "--metrics", spec.format(tmp=tmp_path), timeout=60)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert message in line


@pytest.mark.skipif(tensorboard_available(), reason="the tensorboard package is installed")
def test_schedcc_run_refuses_tensorboard_without_the_package(tmp_path):
    result = run_cli("--steps", "1", "--metrics", f"tb:{tmp_path}", timeout=60)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "pip install tensorboard" in line


def test_a_resumed_schedcc_run_appends_to_its_stream(tmp_path):
    """`--resume` continues the JSONL: steps 1..4 once each, with the counts of their batches."""
    path, ckpt = tmp_path / "run.jsonl", str(tmp_path / "ckpt")
    args = ("--model", "mlp", "-p", "2", "-m", "2", "--metrics", str(path), "--checkpoint", ckpt)
    first = run_cli(*args, "--steps", "2", "--every", "2")
    assert first.returncode == 0, first.stderr
    second = run_cli(*args, "--steps", "4", "--resume")
    assert second.returncode == 0, second.stderr
    assert [r["step"] for r in _read(path)] == [1, 2, 3, 4]
    assert len({r["samples"] for r in _read(path)}) == 1
