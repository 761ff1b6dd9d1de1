"""Checkpoints load into another shape by parameter name; the whole model's state dict.

A run interrupted in one shape (m, schedule, v, p, data-parallel degree, ZeRO) and resumed in
another trains on exactly as a run of the new shape from the start would (float64, Adam);
`Engine.state_dict()` and `schedcc.export` give the whole model under the unsplit model's names;
what cannot carry over is refused before anything changes.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _cli import run_cli

import schedcc
from schedcc.backends.checkpoint import files as ckpt
from schedcc.backends.local import Engine
from schedcc.backends.run.launch import spawn
from schedcc.errors import CheckpointError

WIDTH = 6
BATCH = 16


def _layers(seed, widths=(WIDTH,) * 5, *, bias=lambda i: True):
    """Linear layers of `widths` with a Tanh after each (names "0", "1", ...: layer 2i is the
    i-th Linear)."""
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers += [torch.nn.Linear(a, b, bias=bias(i), dtype=torch.float64), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _adam(params):
    return torch.optim.Adam(params, lr=0.01)


def _engine(name, p, m, v=1, dp=1, zero=0, seed=0, model=None, cut="uniform"):
    model = model if model is not None else _layers(seed)
    segments = schedcc.partition(model, p * v, method=cut)
    program = schedcc.compile(
        schedcc.get_schedule(name)(p, m, num_chunks=v), data_parallel=dp, zero=zero
    )
    return Engine(program, segments, torch.nn.functional.mse_loss, _adam)


def _data(n):
    gen = torch.Generator().manual_seed(123)
    return [
        tuple(torch.randn(BATCH, WIDTH, generator=gen, dtype=torch.float64) for _ in range(2))
        for _ in range(n)
    ]


def _close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


SHAPES = {
    "m 4 -> 8": (("1f1b", {"p": 2, "m": 4}), ("1f1b", {"p": 2, "m": 8})),
    "1f1b -> interleaved v=2": (
        ("1f1b", {"p": 2, "m": 4}),
        ("interleaved-1f1b", {"p": 2, "m": 4, "v": 2}),
    ),
    "ZeRO 1 -> 3, v 1 -> 2": (
        ("1f1b", {"p": 2, "m": 4, "dp": 2, "zero": 1}),
        ("interleaved-1f1b", {"p": 2, "m": 4, "v": 2, "dp": 2, "zero": 3}),
    ),
    "dp 1 -> 2, p 2 -> 4": (("1f1b", {"p": 2, "m": 4}), ("gpipe", {"p": 4, "m": 2, "dp": 2})),
    "another cut at the same p": (
        ("1f1b", {"p": 2, "m": 4}),
        ("1f1b", {"p": 2, "m": 4, "cut": [2]}),
    ),
}


@pytest.mark.parametrize("change", SHAPES)
def test_resume_in_another_shape_equals_the_new_shape_from_the_start(tmp_path, change):
    """Two Adam steps in the old shape, saved, loaded into an engine of the new shape with other
    weights, two more steps: the losses and weights of four steps of the new shape in a row."""
    (old_name, old), (new_name, new) = SHAPES[change]
    data = _data(4)
    first = _engine(old_name, **old)
    list(first.train(data[:2]))
    first.save(tmp_path / "c")
    resumed = _engine(new_name, **new, seed=5)
    resumed.load(tmp_path / "c")
    assert resumed.steps == 2
    losses = list(resumed.train(data[2:]))
    whole = _engine(new_name, **new)
    want = list(whole.train(data))[2:]
    assert max(abs(a - b) for a, b in zip(losses, want, strict=True)) < 1e-12, (losses, want)
    _close(resumed.state_dict(), whole.state_dict(), atol=1e-12)


def test_export_after_zero3_training_gives_the_trained_model_whole(tmp_path):
    """A ZeRO-3 engine holds only shards; its checkpoint exports to full tensors equal to its
    weights, under the unsplit model's names, and loads into the unsplit model."""
    engine = _engine("interleaved-1f1b", 2, 4, v=2, dp=2, zero=3)
    list(engine.train(_data(2)))
    assert all(p.numel() == 0 for seg in engine.segments for p in seg.parameters())
    engine.save(tmp_path / "c")
    exported = schedcc.export(tmp_path / "c")
    model = _layers(7)
    assert exported.keys() == model.state_dict().keys()
    assert all(t.numel() > 0 for t in exported.values())
    with engine.unsharded():
        trained = {n: p.detach().clone() for s in engine.segments for n, p in s.named_parameters()}
    _close(exported, trained, atol=0)
    _close(engine.state_dict(), trained, atol=0)
    model.load_state_dict(exported)
    x, _ = _data(1)[0]
    torch.testing.assert_close(model(x), engine.predict(x), rtol=0, atol=1e-12)


def _snapshot(engine) -> list:
    runtimes = engine._all_runtimes()
    weights = engine.state_dict()
    optimizers = [rt.optimizer.state_dict()["state"] for rt in runtimes if rt.optimizer]
    shards = [shard.clone() for rt in runtimes for shard in rt.state.shards]
    return [weights, optimizers, shards, torch.get_rng_state(), engine.steps]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


REFUSED = {
    "a parameter the model lacks": (
        {"bias": lambda i: i != 1},
        r"2\.bias \(in stage0-dp0\.pt\) is no tensor of this model",
    ),
    "a parameter the checkpoint lacks": (
        {"widths": (WIDTH,) * 6},
        r"this model's 8\.weight \(segment 3\) is in none of its files",
    ),
    "another shape": (
        {"widths": (WIDTH, WIDTH, 5, WIDTH, WIDTH)},
        r"4\.weight is \(6, 6\) torch\.float64 in stage1-dp0\.pt, this model's \(6, 5\)",
    ),
}


@pytest.mark.parametrize("zero", [0, 3])
@pytest.mark.parametrize("case", REFUSED)
def test_what_cannot_carry_over_is_refused_and_nothing_changes(tmp_path, case, zero):
    """A checkpoint of another model loaded into another shape is refused naming the tensor and
    the file, and the engine's weights, optimizer state, shards, RNG state and step count stay
    bitwise as they were."""
    old = _engine("1f1b", 2, 4)
    list(old.train(_data(1)))
    old.save(tmp_path / "c")
    kwargs, match = REFUSED[case]
    dp = 2 if zero else 1
    engine = _engine("interleaved-1f1b", 2, 4, v=2, dp=dp, zero=zero, model=_layers(3, **kwargs))
    list(engine.train(_data(1)))
    before = _snapshot(engine)
    with pytest.raises(CheckpointError, match=match):
        engine.load(tmp_path / "c")
    assert _same(before, _snapshot(engine))


def test_the_rng_state_is_taken_from_global_index_zero(tmp_path):
    """The local engine, one process, restores the RNG state of stage 0, rank 0 (global index
    0) from a checkpoint of another shape, whatever the other shards hold."""
    old = _engine("1f1b", 2, 4)
    old.save(tmp_path / "c")
    states = _distinct_rngs(tmp_path / "c", num_stages=2, dp=1)
    engine = _engine("interleaved-1f1b", 2, 4, v=2)
    engine.load(tmp_path / "c")
    assert torch.equal(torch.get_rng_state(), states[0])


def _distinct_rngs(directory: Path, *, num_stages: int, dp: int) -> list[torch.Tensor]:
    """Give each shard its own CPU RNG state; by global index `dp_rank * p + stage`."""
    states = []
    for r in range(dp):
        for s in range(num_stages):
            name = ckpt.shard_name(s, r)
            shard = torch.load(directory / name, weights_only=True)
            shard["rng"]["cpu"] = torch.Generator().manual_seed(100 + len(states)).get_state()
            ckpt.rewrite_shard(directory, name, shard)
            states.append(shard["rng"]["cpu"])
    return states


def test_a_rank_reads_only_the_shards_that_hold_its_tensors(tmp_path, monkeypatch):
    """Loading by name reads the shards of the stages the manifest's cut says hold the wanted
    names (and the one of the RNG state's global index), not the others."""
    from schedcc.backends.checkpoint import model

    engine = _engine("1f1b", 2, 4, dp=2)
    engine.save(tmp_path / "c")
    manifest = ckpt.read_checkpoint(tmp_path / "c")
    read = []

    def recording(directory, name, manifest):
        read.append(name)
        return ckpt.read_shard(directory, name, manifest)

    monkeypatch.setattr(model, "read_shard", recording)
    names = model.model_names({k: list(s.state_dict()) for k, s in enumerate(engine.segments)})
    saved = model.read_model(tmp_path / "c", manifest, model=names, segments=[1], rng=3)
    assert read == ["stage1-dp0.pt", "stage1-dp1.pt"]
    assert set(saved.tensors) == {f"{k}.{w}" for k in (4, 6) for w in ("weight", "bias")}
    assert len(saved.files) == 8  # every name the checkpoint holds, read or not
    read.clear()
    model.read_model(tmp_path / "c", manifest, model=names, segments=[1], rng=0)
    assert read == [f"stage{s}-dp{r}.pt" for s in (0, 1) for r in (0, 1)]


def test_a_cut_the_shards_contradict_is_refused(tmp_path):
    """A manifest whose cut places a segment on another stage than its shard says is refused
    before anything changes."""
    old = _engine("1f1b", 2, 4)
    old.save(tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / ckpt.MANIFEST).read_text())
    cut = manifest["meta"]["cut"]
    cut[0]["stage"], cut[1]["stage"] = 1, 0
    (tmp_path / "c" / ckpt.MANIFEST).write_text(json.dumps(manifest))
    engine = _engine("interleaved-1f1b", 2, 4, v=2)
    before = _snapshot(engine)
    with pytest.raises(CheckpointError, match="the manifest's cut places otherwise"):
        engine.load(tmp_path / "c")
    assert _same(before, _snapshot(engine))


def _restarting(seed):
    """A builder whose segments number their layers from 0 (the names collide across
    segments, so the model-wide names are segment-prefixed)."""

    def build(k):
        torch.manual_seed(seed * 100 + k)
        return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH, dtype=torch.float64))

    return build


def _built(name, p, m, v=1, seed=0):
    program = schedcc.compile(schedcc.get_schedule(name)(p, m, num_chunks=v))
    return Engine(program, _restarting(seed), torch.nn.functional.mse_loss, _adam)


def test_segments_without_the_models_names_resume_in_their_own_cut_only(tmp_path):
    """Segments whose names collide export as `segment<k>.<key>`; their checkpoint resumes
    across m and schedule (the same cut), and another cut is refused naming the tensor."""
    first = _built("1f1b", 2, 4)
    list(first.train(_data(1)))
    first.save(tmp_path / "c")
    exported = schedcc.export(tmp_path / "c")
    assert list(exported) == [f"segment{k}.0.{w}" for k in range(2) for w in ("weight", "bias")]
    again = _built("gpipe", 2, 8, seed=4)
    again.load(tmp_path / "c")
    _close(again.state_dict(), exported, atol=0)
    other = _built("interleaved-1f1b", 2, 4, v=2, seed=4)
    before = _snapshot(other)
    with pytest.raises(CheckpointError, match=r"segment2\.0\.weight \(segment 2\) is in none"):
        other.load(tmp_path / "c")
    assert _same(before, _snapshot(other))


# -- on gloo: dp 1 -> 2 ---------------------------------------------------------------------------


def _gloo_worker(rank: int, world_size: int, directory: str, out: str) -> int:
    from schedcc.backends.distributed.engine import Engine as DistributedEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    p, dp = 2, 2
    program = schedcc.compile(schedcc.get_schedule("1f1b")(p, 2), data_parallel=dp, zero=3)
    segments = schedcc.partition(_layers(5), p, method="uniform")
    engine = DistributedEngine(
        program, segments, torch.nn.functional.mse_loss, _adam, timeout=60, p2p="gloo"
    )
    before = engine.state_dict()
    # another model's checkpoint: every rank raises rank 0's refusal, and nothing changes
    with pytest.raises(CheckpointError, match=r"rank 0 \(stage 0\): .*2\.weight is \(5, 6\)"):
        engine.load(Path(out) / "other")
    assert _same(before, engine.state_dict()), rank
    engine.load(directory)
    saved = torch.load(Path(out) / "rngs.pt", weights_only=True)
    assert torch.equal(torch.get_rng_state(), saved[rank % len(saved)]), rank
    data = [list(zip(x.chunk(dp), y.chunk(dp))) for x, y in _data(4)[2:]]
    losses = list(engine.train([batch[rank // p] for batch in data]))
    everywhere = engine.state_dict()
    on_zero = engine.state_dict(everywhere=False)
    engine.save(Path(out) / "after")
    if rank == 0:
        assert _same(everywhere, on_zero)
        torch.save({"losses": losses, "state": on_zero}, Path(out) / "rank0.pt")
    else:
        assert on_zero is None
    return 0


def test_gloo_resume_at_twice_the_data_parallel_degree_under_zero3(tmp_path):
    """Another model's checkpoint is refused on every gloo rank, nothing changed; a local p=2,
    m=4 checkpoint resumes on 4 gloo ranks (dp=2, m=2, ZeRO-3): the losses and
    the gathered state dict equal the local engine's of the same shape loading it (1e-12) and
    four steps of that shape from the start; each rank takes the RNG state of its global index
    (modulo the two saved); the checkpoint it saves exports to the same weights."""
    old = _engine("1f1b", 2, 4)
    list(old.train(_data(4)[:2]))
    old.save(tmp_path / "c")
    _engine("1f1b", 2, 4, model=_layers(0, (WIDTH, WIDTH, 5, WIDTH, WIDTH))).save(
        tmp_path / "other"
    )
    rngs = _distinct_rngs(tmp_path / "c", num_stages=2, dp=1)
    torch.save(rngs, tmp_path / "rngs.pt")
    assert spawn(_gloo_worker, 4, (str(tmp_path / "c"), str(tmp_path)), grace=60, threads=1) == 0
    got = torch.load(tmp_path / "rank0.pt", weights_only=True)
    oracle = _engine("1f1b", 2, 2, dp=2, zero=3, seed=8)
    oracle.load(tmp_path / "c")
    want = list(oracle.train(_data(4)[2:]))
    assert max(abs(a - b) for a, b in zip(got["losses"], want, strict=True)) < 1e-12
    _close(got["state"], oracle.state_dict(), atol=1e-12)
    whole = _engine("1f1b", 2, 2, dp=2, zero=3)
    assert max(abs(a - b) for a, b in zip(list(whole.train(_data(4)))[2:], want)) < 1e-12
    _close(schedcc.export(tmp_path / "after"), got["state"], atol=0)
    manifest = json.loads((tmp_path / "after" / ckpt.MANIFEST).read_text())
    assert manifest["meta"]["data_parallel"] == 2
    assert manifest["meta"]["zero"] == 3


# -- schedcc run --resume in another shape --------------------------------------------------------


def _schedcc_run(*args: str) -> subprocess.CompletedProcess:
    return run_cli("--timeout", "20", "--model", "mlp", *args, timeout=240)


def test_schedcc_run_resumes_in_another_schedule_m_and_dp(tmp_path):
    """`schedcc run --resume` continues a 1f1b, m=4 run's step-2 checkpoint under gpipe, m=2,
    at dp=2 (the same global batch): its step-4 checkpoint holds the weights of the
    uninterrupted 1f1b run's."""
    whole = tmp_path / "whole"
    done = _schedcc_run(
        "--schedule", "1f1b", "-m", "4", "--steps", "4", "--checkpoint", str(whole), "--every", "2"
    )
    assert done.returncode == 0, done.stderr
    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "step-00000002", resumed / "step-00000002")
    again = _schedcc_run(
        "--schedule", "gpipe", "-m", "2", "--dp", "2", "--steps", "4",
        "--checkpoint", str(resumed), "--every", "2", "--resume",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout
    _close(
        schedcc.export(resumed / "step-00000004"),
        schedcc.export(whole / "step-00000004"),
        atol=1e-6,
    )
