"""Learning-rate schedulers (`Engine(..., lr_scheduler=factory)`): each stage's optimizer steps
its own, once per optimizer step, so pipelined training equals the non-pipelined loop with the
same scheduler (flush and weight-delayed schedules, ZeRO, gloo ranks); a checkpoint holds its
state and a resumed run continues exactly; a skipped step does not advance it; a factory that
fails or returns something else is refused naming it."""

from __future__ import annotations

import copy
import math
import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _cli import run_cli
from _models import linear_segments, tanh_batches
from torch import nn

import schedcc
from schedcc.backends.checkpoint.files import read_manifest, read_shard, rewrite_shard
from schedcc.backends.distributed.engine import Engine as DistEngine
from schedcc.backends.local import Engine
from schedcc.backends.reference import assert_matches_reference, train_reference
from schedcc.backends.run.launch import spawn
from schedcc.errors import CheckpointError, ScheduleConfigError, UserCodeError

WIDTH = 4


def _segments(n: int, seed: int = 0) -> list[nn.Module]:
    return linear_segments(n, width=WIDTH, seed=seed)


def _batches(count: int, size: int = 8, seed: int = 1) -> list:
    return tanh_batches(count, size, width=WIDTH, seed=seed)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def _adam(params):
    return torch.optim.Adam(params, lr=0.05)


def _warmup_cosine(optimizer):
    """Linear warmup over 2 steps, then a cosine decay to 0 at step 8."""

    def factor(step: int) -> float:
        if step < 2:
            return (step + 1) / 2
        return 0.5 * (1 + math.cos(math.pi * min(step - 2, 6) / 6))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _one_cycle(optimizer):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.3, total_steps=12)


def _params(segments) -> list[torch.Tensor]:
    return [p.detach().clone() for s in segments for p in s.parameters()]


@pytest.mark.parametrize(
    ("name", "kwargs", "zero", "scheduler", "optimizer"),
    [
        ("1f1b", {}, 0, _one_cycle, _sgd),
        ("1f1b", {}, 0, _warmup_cosine, _adam),
        ("2bw", {"num_batches": 2}, 0, _warmup_cosine, _sgd),
        ("2bw", {"num_batches": 2}, 1, _one_cycle, _adam),
        ("interleaved-1f1b", {"num_chunks": 2}, 0, _one_cycle, _sgd),
    ],
    ids=[
        "1f1b-onecycle",
        "1f1b-warmup-cosine-adam",
        "2bw-warmup-cosine",
        "2bw-zero1-onecycle",
        "interleaved-onecycle",
    ],
)
def test_a_scheduled_run_equals_the_non_pipelined_loop(name, kwargs, zero, scheduler, optimizer):
    """With a scheduler, losses and weights equal the non-pipelined loop that steps the same
    scheduler once per batch (float64, 1e-10), weight delay and ZeRO-1 included."""
    schedule = schedcc.get_schedule(name)(2, 4, **kwargs)
    dp = 2 if zero else 1
    program = schedcc.compile(schedule, data_parallel=dp, zero=zero)
    segments = _segments(schedule.num_segments)
    worst = assert_matches_reference(
        program, segments, F.mse_loss, optimizer, _batches(8), lr_scheduler=scheduler
    )
    assert worst < 1e-10
    # and the schedule mattered: without it the weights end elsewhere
    plain, scheduled = copy.deepcopy(segments), copy.deepcopy(segments)
    train_reference(
        plain,
        F.mse_loss,
        optimizer,
        _batches(8),
        weight_delay=schedule.weight_delay,
        batches_per_run=schedule.num_batches,
    )
    train_reference(
        scheduled,
        F.mse_loss,
        optimizer,
        _batches(8),
        weight_delay=schedule.weight_delay,
        batches_per_run=schedule.num_batches,
        lr_scheduler=scheduler,
    )
    gap = max((a - b).abs().max().item() for a, b in zip(_params(plain), _params(scheduled)))
    assert gap > 1e-3


def test_every_stage_steps_its_scheduler_once_per_step():
    """After 5 steps every stage's scheduler has taken 5 steps and its optimizer's rate is the
    scheduler's."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(3, 3))
    engine = Engine(program, _segments(3), F.mse_loss, _sgd, lr_scheduler=_one_cycle)
    for x, y in _batches(5, size=6):
        engine.train_step(x, y)
    for runtime in engine.runtimes[0]:
        assert runtime.lr_scheduler.last_epoch == 5
        lr = runtime.optimizer.param_groups[0]["lr"]
        assert lr == runtime.lr_scheduler.get_last_lr()[0]
    reference = _one_cycle(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.2))
    for _ in range(5):
        reference.optimizer.step()
        reference.step()
    assert lr == reference.get_last_lr()[0]


def _resumed(tmp_path, name: str, kwargs: dict, engine_of) -> None:
    schedule = schedcc.get_schedule(name)(2, 4, **kwargs)
    program = schedcc.compile(schedule)
    batches = _batches(8)
    per_run = schedule.num_batches
    whole_segments = _segments(schedule.num_segments)
    first_segments = copy.deepcopy(whole_segments)
    whole = engine_of(program, whole_segments)
    expected = list(whole.train(batches))
    first = engine_of(program, first_segments)
    got = list(first.train(batches[: 2 * per_run]))
    manifest = first.save(tmp_path / "ckpt")
    second_segments = _segments(schedule.num_segments, seed=7)  # other weights, reset schedule
    second = engine_of(program, second_segments)
    second.load(manifest)
    got += list(second.train(batches[2 * per_run :]))
    assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-12, (got, expected)
    for a, b in zip(_params(second_segments), _params(whole_segments)):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    for rt, want in zip(second.runtimes[0], whole.runtimes[0]):
        assert rt.lr_scheduler.state_dict() == want.lr_scheduler.state_dict()


@pytest.mark.parametrize(("name", "kwargs"), [("1f1b", {}), ("2bw", {"num_batches": 2})])
def test_resuming_mid_schedule_continues_identically(tmp_path, name, kwargs):
    """Saved mid-schedule and loaded into a fresh engine (other weights, its scheduler at step
    0), training continues to the losses, weights and scheduler state of an uninterrupted
    run."""

    def engine_of(program, segments):
        return Engine(program, segments, F.mse_loss, _adam, lr_scheduler=_warmup_cosine)

    _resumed(tmp_path, name, kwargs, engine_of)


def test_a_checkpoint_without_scheduler_state_is_refused(tmp_path):
    """An engine with a scheduler refuses a checkpoint saved without one (and one whose
    scheduler state is of another kind, or altered), changing nothing."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    plain = Engine(program, _segments(2), F.mse_loss, _sgd)
    plain.train_step(*_batches(1)[0])
    manifest = plain.save(tmp_path / "plain")
    engine = Engine(program, _segments(2), F.mse_loss, _sgd, lr_scheduler=_one_cycle)
    with pytest.raises(CheckpointError, match="holds no lr_scheduler state"):
        engine.load(manifest)
    cosine = Engine(program, _segments(2), F.mse_loss, _sgd, lr_scheduler=_warmup_cosine)
    cosine.train_step(*_batches(1)[0])
    path = cosine.save(tmp_path / "cosine").parent
    with pytest.raises(CheckpointError, match="another kind of scheduler"):
        engine.load(path)
    state = read_shard(path, "stage0-dp0.pt", read_manifest(path))
    state["lr_scheduler"]["last_epoch"] = -3
    rewrite_shard(path, "stage0-dp0.pt", state)
    again = Engine(program, _segments(2), F.mse_loss, _sgd, lr_scheduler=_warmup_cosine)
    with pytest.raises(CheckpointError, match=r"lr_scheduler\['last_epoch'\] is -3"):
        again.load(path)
    assert again.runtimes[0][0].lr_scheduler.last_epoch == 0


def test_a_skipped_step_does_not_advance_the_scheduler():
    """A batch whose gradients are not finite is skipped (grad_norm=True): its scheduler stays
    where it was, and the run equals the non-pipelined loop that skips it alike."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4), grad_norm=True)
    batches = _batches(4)
    x, y = batches[1]
    x = x.clone()
    x[3, 0] = math.inf
    batches[1] = (x, y)
    segments = _segments(2)
    plain = copy.deepcopy(segments)
    engine = Engine(program, segments, F.mse_loss, _sgd, max_grad_norm=1.0, lr_scheduler=_one_cycle)
    list(engine.train(batches))
    assert engine.skipped_steps == 1
    assert [rt.lr_scheduler.last_epoch for rt in engine.runtimes[0]] == [3, 3]
    train_reference(
        plain,
        F.mse_loss,
        _sgd,
        batches,
        max_grad_norm=1.0,
        skip_nonfinite=True,
        lr_scheduler=_one_cycle,
    )
    for a, b in zip(_params(segments), _params(plain)):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def _broken(optimizer):
    raise RuntimeError("no schedule today")


@pytest.mark.parametrize(
    ("factory", "error", "match"),
    [
        (_broken, UserCodeError, "the lr_scheduler factory .*_broken raised RuntimeError"),
        (lambda opt: None, ScheduleConfigError, "returned None, not a torch.optim.lr_scheduler"),
        (
            lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
            ScheduleConfigError,
            "whose step needs a metric",
        ),
        ("cosine", ScheduleConfigError, "lr_scheduler must be None or a callable"),
    ],
    ids=["raises", "returns-none", "plateau", "not-callable"],
)
def test_a_bad_scheduler_factory_is_refused(factory, error, match):
    """A factory that raises, returns no scheduler or a metric-driven one, or is no callable,
    is refused before anything runs, naming it and the fix."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    with pytest.raises(error, match=match):
        Engine(program, _segments(2), F.mse_loss, _sgd, lr_scheduler=factory)


def test_load_takes_the_manifest_save_returns_or_its_folder(tmp_path):
    """`engine.load(engine.save(path))` restores what was saved, as `load(path)` does."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    engine = Engine(program, _segments(2), F.mse_loss, _sgd, lr_scheduler=_one_cycle)
    engine.train_step(*_batches(1)[0])
    manifest = engine.save(tmp_path / "ckpt")
    assert manifest.name == "manifest.json"
    for where in (manifest, manifest.parent, str(manifest)):
        other = Engine(program, _segments(2, seed=3), F.mse_loss, _sgd, lr_scheduler=_one_cycle)
        other.load(where)
        assert other.steps == 1
        assert all(
            torch.equal(a, b) for a, b in zip(_params(other.segments), _params(engine.segments))
        )


def test_schedcc_run_schedules_the_default_optimizer():
    """`schedcc run --lr-schedule cosine --warmup 2 --check`: every rank steps the warmup and
    cosine schedule, and the run equals the non-pipelined loop stepping it."""
    result = run_cli(
        "--model",
        "mlp",
        "-p",
        "2",
        "-m",
        "2",
        "--steps",
        "4",
        "--lr-schedule",
        "cosine",
        "--warmup",
        "2",
        "--check",
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"check: .*: ok", result.stdout), result.stdout


# -- on gloo ranks --------------------------------------------------------------------------------


def _gloo_worker(rank: int, world_size: int, root: str) -> int:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    batches = _batches(6)
    segments = _segments(2)
    oracle = copy.deepcopy(segments)
    engine = DistEngine(
        program, segments, F.mse_loss, _adam, timeout=20, lr_scheduler=_warmup_cosine
    )
    losses = list(engine.train(batches[:3]))
    manifest = engine.save(root)
    resumed = DistEngine(
        program, _segments(2, seed=5), F.mse_loss, _adam, timeout=20, lr_scheduler=_warmup_cosine
    )
    resumed.load(manifest)
    losses += list(resumed.train(batches[3:]))
    expected = train_reference(oracle, F.mse_loss, _adam, batches, lr_scheduler=_warmup_cosine)
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12, (losses, expected)
    k = engine.stage
    for a, b in zip(resumed.modules[0].parameters(), oracle[k].parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), rank
    assert resumed.runtime.lr_scheduler.last_epoch == 6
    dist.destroy_process_group()
    return 0


def test_on_gloo_ranks_a_scheduled_run_and_its_resume_equal_the_loop(tmp_path):
    """1f1b on 2 gloo ranks with a warmup-cosine schedule, saved after 3 steps and resumed on a
    fresh engine, equals the non-pipelined loop with the same scheduler."""
    assert spawn(_gloo_worker, 2, (str(tmp_path / "ckpt"),), grace=30, threads=1) == 0


def test_a_scheduled_run_resumes_under_another_microbatch_count(tmp_path):
    """Saved after two steps at m = 2 and loaded by name into m = 4 (the same batches, so the
    same objective): the scheduler goes on where it was, and the run equals one at m = 4 from the
    start."""
    data = _batches(4)

    def engine_of(m: int) -> Engine:
        program = schedcc.compile(schedcc.get_schedule("1f1b")(2, m))
        return Engine(program, _segments(2), F.mse_loss, _adam, lr_scheduler=_warmup_cosine)

    first = engine_of(2)
    list(first.train(data[:2]))
    later = engine_of(4)
    later.load(first.save(tmp_path / "ckpt"))
    resumed = list(later.train(data[2:]))
    straight = engine_of(4)
    expected = list(straight.train(data))[2:]
    assert resumed == pytest.approx(expected, abs=1e-12, rel=0)
    for got, want in zip(later._runtimes(), straight._runtimes()):
        assert got.lr_scheduler.state_dict() == want.lr_scheduler.state_dict()
