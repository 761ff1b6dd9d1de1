"""Segments built by a builder `build(k)`: each engine builds only what it holds, and trains
exactly as when given the whole model; `RunModel` factories that build only some segments; the
rank layout of the default mesh; a gloo group with CUDA tensors refused.

The multi-process tests are one launch each (gloo on 127.0.0.1, forked, one thread a rank); a
rank that sees a difference raises, which makes the launch exit non-zero.
"""

from __future__ import annotations

import gc
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _cli import ROOT, run_cli
from torch import nn

import schedcc
from schedcc.backends.distributed import engine as distributed_engine
from schedcc.backends.distributed.engine import Engine
from schedcc.backends.distributed.groups import default_mesh
from schedcc.backends.engine import is_builder
from schedcc.backends.local import Engine as LocalEngine
from schedcc.backends.run import models
from schedcc.backends.run.gpt import GPT, GPTConfig, PaddedBigramData, gpt_segment, gpt_segments
from schedcc.backends.run.gpt import token_loss as gpt_loss
from schedcc.backends.run.launch import spawn
from schedcc.cli.run import Config
from schedcc.errors import ScheduleConfigError, UserError

CONFIG = GPTConfig(vocab=16, max_len=8, d_model=8, num_heads=2, num_blocks=4)
DATA = PaddedBigramData(vocab=16, max_len=8, min_len=3, seed=3)


def _optimizer(params):
    return torch.optim.Adam(params, lr=0.01)


def _mlp_builder(num_segments: int, calls: list[int] | None = None):
    def build(k: int) -> nn.Module:
        if calls is not None:
            calls.append(k)
        return models.mlp_segments(num_segments, width=8, seed=1, segments=(k,))[k]

    return build


def _gpt_builder(num_segments: int, calls: list[int] | None = None):
    def build(k: int) -> nn.Module:
        if calls is not None:
            calls.append(k)
        return gpt_segment(CONFIG, k, num_segments, seed=5)

    return build


def _mlp_batches(m: int, steps: int, dp: int = 1):
    data = models.TeacherData(width=8, seed=2)
    return [data.batch(2 * m * dp, step) for step in range(steps)]


def _gpt_batches(m: int, steps: int):
    return [DATA.batch(2 * m, step) for step in range(steps)]


def _max_difference(a: list[nn.Module], b: list[nn.Module]) -> float:
    return max(
        float((x - y).abs().max())
        for ma, mb in zip(a, b)
        for x, y in zip(ma.state_dict().values(), mb.state_dict().values())
    )


# -- built alone, as in the whole model --------------------------------------------------------


@pytest.mark.parametrize("num_segments", [1, 2, 3, 4])
def test_a_gpt_segment_built_alone_equals_the_whole_models(num_segments):
    """`gpt_segment(config, k, n)` has the modules and values of segment k of the whole GPT, and
    the last one's head starts equal to the first one's token embedding."""
    whole = gpt_segments(GPT(CONFIG, seed=5), num_segments)
    for k in range(num_segments):
        alone = gpt_segment(CONFIG, k, num_segments, seed=5)
        want = whole[k].state_dict()
        got = alone.state_dict()
        assert list(got) == list(want), k
        assert all(torch.equal(got[name], want[name]) for name in want), k
    last = gpt_segment(CONFIG, num_segments - 1, num_segments, seed=5)
    assert torch.equal(last.head.weight, whole[0].tok.weight)
    if num_segments == 1:  # one segment holds the tie as one Parameter, as the GPT does
        assert last.head.weight is last.tok.weight


@pytest.mark.parametrize("name", ["tiny-gpt", "mlp", f"{ROOT}/examples/char_lm.py:make"])
def test_the_built_in_factories_build_segments_alone_as_in_the_whole_model(name):
    """Asked for some segments, `tiny-gpt`, `mlp` and the example build just those, with the
    names and values they have in the whole model."""
    whole = models.build(name, 4, seed=3).segments
    for some in ((0,), (1, 3)):
        built = models.build(name, 4, seed=3, segments=some).segments
        assert sorted(built) == list(some), name
        for k in some:
            want, got = whole[k].state_dict(), built[k].state_dict()
            assert list(got) == list(want), (name, k)
            assert all(torch.equal(got[n], want[n]) for n in want), (name, k)


def test_build_cuts_an_old_factory_and_asks_a_new_one():
    """`models.build(..., segments=)` passes the indices to a factory that takes them, keeps
    only those of one that does not (the others are freed), and refuses a factory that returns
    others."""
    asked = []

    def new(num_segments, *, seed, segments=None):
        asked.append(segments)
        return models.mlp(num_segments, seed=seed, segments=segments)

    made = []

    def old(num_segments, *, seed):
        model = models.mlp(num_segments, seed=seed)
        made.extend(weakref.ref(segment) for segment in model.segments)
        return model

    def wrong(num_segments, *, seed, segments=None):
        return models.mlp(num_segments, seed=seed, segments=(0,))

    models.BUILT_IN.update(new=new, old=old, wrong=wrong)
    try:
        assert sorted(models.build("new", 4, segments=(2, 1)).segments) == [1, 2]
        assert asked == [(2, 1)]
        kept = models.build("old", 4, segments=(3,)).segments
        assert sorted(kept) == [3]
        gc.collect()
        assert [ref() is not None for ref in made] == [False, False, False, True]  # dropped
        with pytest.raises(UserError, match=r"returned segments \[0\].*exactly \[1, 2\]"):
            models.build("wrong", 4, segments=(1, 2))
    finally:
        for name in ("new", "old", "wrong"):
            del models.BUILT_IN[name]


# -- the local engine --------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "v"), [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2)])
def test_the_local_engine_trains_built_segments_as_the_whole_model(name, v):
    """A builder gives the local engine the same training as the model's segments: the MLP, and
    the tied GPT (its head and embedding built apart, tied by value; on zb-v stage 0 holds
    both and trains each)."""
    schedule = schedcc.get_schedule(name)(2, 4, v)
    n = schedule.num_segments
    plain = schedcc.compile(schedule)
    calls: list[int] = []
    built = LocalEngine(plain, _mlp_builder(n, calls), F.mse_loss, _optimizer)
    whole = models.mlp_segments(n, width=8, seed=1)
    expected = list(LocalEngine(plain, whole, F.mse_loss, _optimizer).train(_mlp_batches(4, 2)))
    assert calls == list(range(n))
    assert list(built.train(_mlp_batches(4, 2))) == expected
    assert _max_difference(built.segments, whole) == 0.0

    tied = schedcc.compile(schedule, tied=[(0, n - 1)])
    built = LocalEngine(tied, _gpt_builder(n), gpt_loss, _optimizer)
    whole = gpt_segments(GPT(CONFIG, seed=5), n)
    reference = LocalEngine(tied, whole, gpt_loss, _optimizer)
    assert list(built.train(_gpt_batches(4, 2))) == list(reference.train(_gpt_batches(4, 2)))
    assert _max_difference(built.segments, whole) == 0.0
    assert torch.equal(built.segments[n - 1].head.weight, built.segments[0].tok.weight)


def test_dualpipe_builds_each_segment_once_for_both_replicas():
    """Under DualPipe the builder is called once per segment of the model, and the module is
    held by both replicas, as when the caller passes the same segments twice."""
    schedule = schedcc.get_schedule("dualpipe")(2, 4)
    program = schedcc.compile(schedule)
    calls: list[int] = []
    built = LocalEngine(program, _mlp_builder(2, calls), F.mse_loss, _optimizer)
    assert calls == [0, 1]
    assert built.segments[2] is built.segments[0]
    whole = models.mlp_segments(2, width=8, seed=1) * 2
    expected = list(LocalEngine(program, whole, F.mse_loss, _optimizer).train(_mlp_batches(4, 2)))
    assert list(built.train(_mlp_batches(4, 2))) == expected


def test_a_builder_that_fails_is_named_with_its_segment():
    """A builder that raises, or returns something that is not a module, is a
    `ScheduleConfigError` naming the segment; a module or a Sequential is never a builder."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))

    def raises(k):
        if k == 1:
            raise ValueError("no such layer\nsecond line")
        return nn.Linear(8, 8)

    with pytest.raises(ScheduleConfigError, match=r"build\(1\) raised ValueError: no such layer;"):
        LocalEngine(program, raises, F.mse_loss, _optimizer)
    with pytest.raises(ScheduleConfigError, match=r"build\(0\) returned a str, not a torch"):
        LocalEngine(program, lambda k: "layer", F.mse_loss, _optimizer)
    assert is_builder(lambda k: nn.Linear(2, 2))
    assert not is_builder(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert not is_builder(nn.Linear(2, 2))


# -- the distributed engine --------------------------------------------------------------------


def _init(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))


def _bytes(modules) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def _alive_parameter_bytes() -> int:
    """The bytes of every `nn.Parameter` this process holds."""
    gc.collect()
    return sum(p.numel() * p.element_size() for p in gc.get_objects() if type(p) is nn.Parameter)


def _builder_worker(rank: int, world_size: int) -> int:
    _init(rank, world_size)
    for name, v in (("1f1b", 1), ("zb-v", 2)):
        _built_alone(rank, schedcc.get_schedule(name)(2, 4, v))
    _dualpipe_ties_every_copy(rank)
    _cuda_under_gloo_is_refused()
    dist.barrier()  # rank 0 holds the store: it waits until every rank is done with it
    return 0


def _built_alone(rank: int, schedule) -> None:
    """The engine of `schedule` with the tied GPT's builder: what it builds, holds and trains."""
    n, v = schedule.num_segments, schedule.num_chunks
    held = [schedule.segment_of(rank, c) for c in range(v)]
    program = schedcc.compile(schedule, tied=[(0, n - 1)])
    calls: list[int] = []
    before = _alive_parameter_bytes()
    engine = Engine(program, _gpt_builder(n, calls), gpt_loss, _optimizer, timeout=30)
    made = _alive_parameter_bytes() - before  # everything the engine's making left alive
    whole = gpt_segments(GPT(CONFIG, seed=5), n)
    where = f"{schedule!r} rank {rank}"
    assert calls == held, (where, calls)
    own = _bytes(whole[k] for k in held)
    assert made == _bytes(engine.modules) == own < _bytes(whole), (where, made, own)
    batches = _gpt_batches(4, 2)
    losses = list(engine.train(batches))
    expected = list(LocalEngine(program, whole, gpt_loss, _optimizer).train(batches))
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12, (where, losses)
    assert _max_difference(engine.modules, [whole[k] for k in held]) < 1e-12, where


def _dualpipe_ties_every_copy(rank: int) -> None:
    """DualPipe's replicas built apart on each rank stay equal: every parameter of a segment's
    copy is tied to it, the constant ones (norm gains, zero biases) by name."""
    schedule = schedcc.get_schedule("dualpipe")(2, 4)
    program = schedcc.compile(schedule, tied=[(0, 1)])
    engine = Engine(program, _gpt_builder(2), gpt_loss, _optimizer, timeout=30)
    whole = gpt_segments(GPT(CONFIG, seed=5), 2) * 2
    batches = _gpt_batches(4, 2)
    losses = list(engine.train(batches))
    expected = list(LocalEngine(program, whole, gpt_loss, _optimizer).train(batches))
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12, (rank, losses)
    held = [schedule.segment_of(rank, c) for c in range(schedule.num_chunks)]
    assert _max_difference(engine.modules, [whole[k] for k in held]) < 1e-12, rank


def _cuda_under_gloo_is_refused() -> None:
    real = distributed_engine.device_of
    distributed_engine.device_of = lambda modules: torch.device("cuda", 0)
    try:
        program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
        with pytest.raises(ScheduleConfigError, match=r'process group is gloo.*"nccl"'):
            Engine(program, _mlp_builder(2), F.mse_loss, _optimizer)
    finally:
        distributed_engine.device_of = real


def test_a_rank_built_from_a_builder_holds_only_its_own_segments():
    """On 2 gloo ranks (1F1B, and zb-v whose stage 0 holds both tied ends), the builder is
    called for the rank's own segments only, the engine leaves exactly their parameter bytes
    alive in the process,
    and the tied GPT trains as on the local engine, under DualPipe too; CUDA segments under
    gloo are refused."""
    assert spawn(_builder_worker, 2, grace=30, threads=1) == 0


#: Under each order, for dp=2 p=2: the global ranks of the pipelines and of the data-parallel
#: groups ([Note: rank layout]).
LAYOUTS = {
    "pp-inner": ([[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    "dp-inner": ([[0, 2], [1, 3]], [[0, 1], [2, 3]]),
}


def _layout_worker(rank: int, world_size: int) -> int:
    _init(rank, world_size)
    schedule = schedcc.get_schedule("1f1b")(2, 4)
    program = schedcc.compile(schedule, data_parallel=2)
    batches = _mlp_batches(4, 2, dp=2)
    replicas = [list(zip(x.chunk(2), y.chunk(2))) for x, y in batches]
    expected = list(LocalEngine(program, _mlp_builder(2), F.mse_loss, _optimizer).train(replicas))
    for order, (pipelines, replicas_of) in LAYOUTS.items():
        engine = Engine(program, _mlp_builder(2), F.mse_loss, _optimizer, rank_order=order)
        pp = dist.get_process_group_ranks(engine.pp_group)
        dp = dist.get_process_group_ranks(engine.dp_group)
        assert pp == next(ranks for ranks in pipelines if rank in ranks), (order, pp)
        assert dp == next(ranks for ranks in replicas_of if rank in ranks), (order, dp)
        assert engine.stage == pp.index(rank), order
        config = _config(order)
        r = engine.data_parallel.rank
        assert config.describe(rank) == f"rank {rank} (stage {engine.stage}, dp {r})", order
        losses = list(engine.train([replicas[step][r] for step in range(2)]))
        assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12, (order, losses)
    with pytest.raises(ScheduleConfigError, match="rank_order must be one of"):
        Engine(program, _mlp_builder(2), F.mse_loss, _optimizer, rank_order="tp-inner")
    mesh = default_mesh("cpu", 2, 2, rank_order="dp-inner")  # a mesh brings its own order
    with pytest.raises(ScheduleConfigError, match="bring their own order"):
        Engine(program, _mlp_builder(2), F.mse_loss, _optimizer, groups=mesh, rank_order="pp-inner")
    engine = Engine(program, _mlp_builder(2), F.mse_loss, _optimizer, groups=mesh)
    assert dist.get_process_group_ranks(engine.pp_group) == LAYOUTS["dp-inner"][0][rank % 2]
    dist.barrier()  # rank 0 holds the store: it waits until every rank is done with it
    return 0


def _config(rank_order: str) -> Config:
    """`schedcc run`'s configuration of 1F1B at p=2, dp=2 in `rank_order`."""
    return Config(
        schedule="1f1b",
        num_stages=2,
        num_microbatches=4,
        num_chunks=1,
        num_batches=1,
        data_parallel=2,
        zero=0,
        steps=2,
        model="mlp",
        microbatch_size=2,
        lr=None,
        seed=0,
        trace=None,
        check=False,
        timeout=60.0,
        progress=False,
        rank_order=rank_order,
    )


def test_the_rank_order_lays_out_pipelines_and_replicas():
    """4 gloo ranks, dp=2 p=2: "pp-inner" makes pipelines of consecutive ranks, "dp-inner"
    (Megatron-LM's) data-parallel groups of consecutive ranks; both train exactly, and a mesh
    of either order is taken as it is (not with a `rank_order` beside it)."""
    assert spawn(_layout_worker, 4, grace=30, threads=1) == 0


# -- schedcc run -------------------------------------------------------------------------------

RECORDING_FACTORY = """
import os

from schedcc.backends.run import models


def make(num_segments, *, seed, segments=None):
    with open(os.environ["SCHEDCC_TEST_LOG"], "a") as log:
        log.write(f"{os.environ.get('RANK', 'launcher')} {segments}\\n")
    return models.tiny_gpt(num_segments, seed=seed, segments=segments)
"""


def test_schedcc_run_builds_on_each_rank_only_its_own_segments(tmp_path, monkeypatch):
    """`schedcc run` asks the factory, on each rank, for that rank's stage's segments alone
    (the launcher, and rank 0 for `--check`, build the whole model), under Megatron-LM's
    rank order too, and the run still equals non-pipelined training."""
    factory = tmp_path / "recording.py"
    factory.write_text(RECORDING_FACTORY)
    log = tmp_path / "log"
    monkeypatch.setenv("SCHEDCC_TEST_LOG", str(log))
    args = ["--model", f"{factory}:make", "--schedule", "interleaved-1f1b", "-v", "2"]
    args += ["-p", "2", "--dp", "2", "-m", "4", "--steps", "2", "--check"]
    result = run_cli(*args, "--rank-order", "dp-inner")
    assert result.returncode == 0, result.stderr
    assert "check: largest parameter difference" in result.stdout
    lines = sorted(log.read_text().splitlines())
    # dp-inner: ranks 0 and 1 are stage 0 (segments 0 and 2), ranks 2 and 3 stage 1
    assert lines == sorted(
        ["launcher None", "0 None", "0 (0, 2)", "1 (0, 2)", "2 (1, 3)", "3 (1, 3)"]
    ), lines
