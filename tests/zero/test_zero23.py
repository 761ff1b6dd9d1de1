"""ZeRO-2 and ZeRO-3 train exactly, on the local backend and on 4 gloo ranks (dp=2 x p=2).

Under ZeRO-3 a rank holds each chunk's parameters whole only between its `Unshard` and its
`Reshard`; elsewhere it keeps its flat shard alone, which these tests measure.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _models import batches, make_segments, mse, sgd

import schedcc
from schedcc.backends.distributed.engine import Engine
from schedcc.backends.local import Engine as LocalEngine
from schedcc.backends.reference import assert_matches_reference, train_reference
from schedcc.backends.run import models
from schedcc.backends.run.launch import spawn
from schedcc.ir import OptimizerStep, Recompute, ReduceGrads, Reshard, Unshard


def _held(modules) -> int:
    """The parameter values the modules hold now (numel of the materialised parameters)."""
    return sum(p.numel() for mod in modules for p in mod.parameters())


def _grads(modules) -> int:
    """The gradient values the modules' parameters hold now."""
    return sum(p.grad.numel() for mod in modules for p in mod.parameters() if p.grad is not None)


def _watch(runtime, record: list, grads: list | None = None) -> None:
    """Record, before every instruction `runtime` runs, (instruction, values its modules hold);
    and in `grads`, after each, (instruction, gradient values its modules hold)."""
    run = runtime.run

    def watched(op):
        record.append((op, _held(runtime.modules)))
        run(op)
        if grads is not None:
            grads.append((op, _grads(runtime.modules)))

    runtime.run = watched


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize(("name", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_local_zero_2_and_3_equal_non_pipelined_training(name, v, zero):
    """dp=2 with ZeRO-2 or ZeRO-3 on the local backend equals non-pipelined training to 1e-10."""
    schedule = schedcc.get_schedule(name)(2, 4, num_chunks=v, num_batches=2)
    program = schedcc.compile(schedule, data_parallel=2, zero=zero)
    local = list(zip(batches(2, 4, seed=1), batches(2, 4, seed=2)))
    assert_matches_reference(program, make_segments(schedule.num_segments), mse, sgd, local)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_local_zero3_with_recompute_equals_non_pipelined_training(name):
    """Every forward recomputed before its backward, on weights gathered again by that chunk's
    `Unshard`: still non-pipelined training to 1e-10, with an `R` inside each whole window."""
    schedule = schedcc.get_schedule(name)(2, 4, num_batches=2)
    program = schedcc.compile(schedule, data_parallel=2, zero=3, recompute=True)
    assert any(type(op) is Recompute for op in program.stages[0])
    local = list(zip(batches(2, 4, seed=1), batches(2, 4, seed=2)))
    assert_matches_reference(program, make_segments(schedule.num_segments), mse, sgd, local)


def test_zero_with_one_replica_keeps_training_exactly():
    """zero=2 and zero=3 with data_parallel=1 compile and train as before: the one shard is
    the whole chunk."""
    schedule = schedcc.get_schedule("1f1b")(2, 4, num_batches=2)
    for zero in (2, 3):
        program = schedcc.compile(schedule, zero=zero)
        assert_matches_reference(program, make_segments(2), mse, sgd, batches(2, 4))


def test_local_zero3_holds_a_shard_between_uses():
    """Under ZeRO-3 (dp=2) each stage holds no whole parameters between runs and before each
    Unshard; only its shard, half the chunk's values; whole from Unshard to Reshard."""
    schedule = schedcc.get_schedule("interleaved-1f1b")(2, 4, num_chunks=2)
    program = schedcc.compile(schedule, data_parallel=2, zero=3)
    width = 8
    segments = make_segments(4, width=width)
    engine = LocalEngine(program, segments, mse, sgd)
    records = [[] for _ in engine.runtimes[0]]
    for rt, record in zip(engine.runtimes[0], records):
        _watch(rt, record)
    full = width * width + width  # one segment's values
    for step in range(2):
        (x, y) = batches(1, 8, seed=step, width=width)[0]
        engine.train_step(x, y)
        for runtimes in engine.runtimes:
            for rt in runtimes:
                assert _held(rt.modules) == 0  # between batches: no whole parameter
                assert [s.numel() for s in rt.state.shards] == [full // 2] * 2
    for rt, record in zip(engine.runtimes[0], records):
        whole = {0: False, 1: False}
        for op, held in record:
            assert held == full * sum(whole.values()), (rt.stage, op)
            if type(op) is Unshard:
                whole[op.chunk] = True
            elif type(op) is Reshard:
                whole[op.chunk] = False
        assert sum(type(op) is Unshard for op, _ in record) == 4  # per chunk and batch
    with engine.unsharded():
        assert _held(segments) == 4 * full
    assert _held(segments) == 0


def _stored(runtime) -> int:
    """Bytes of the distinct storages behind a runtime's parameters and shards."""
    tensors = [p for mod in runtime.modules for p in mod.parameters()] + runtime.state.shards
    return sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()
    )


def test_zero3_keeps_one_copy_of_a_whole_chunk():
    """While a chunk is whole its shard is a slice of the gathered buffer (whole size held,
    not whole + shard); after the Reshard only the shard's bytes stay."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4), data_parallel=2, zero=3)
    engine = LocalEngine(program, make_segments(2, width=8), mse, sgd)
    runtime = engine.runtimes[0][0]
    after: list = []
    run = runtime.run

    def watched(op):
        run(op)
        after.append((type(op), _stored(runtime)))

    runtime.run = watched
    engine.train_step(*batches(1, 8, width=8)[0])
    whole = (8 * 8 + 8) * 8  # one segment in float64
    assert (Unshard, whole) in after
    assert after[-2:] == [(Reshard, whole // 2), (OptimizerStep, whole // 2)]


def test_zero3_forward_only_runs_on_sharded_weights():
    """`evaluate` under ZeRO-3 gathers and releases around its forwards: the loss is the
    non-pipelined one and nothing stays whole."""
    schedule = schedcc.get_schedule("1f1b")(2, 4)
    program = schedcc.compile(schedule, data_parallel=2, zero=3)
    segments = make_segments(2)
    plain = copy.deepcopy(segments)
    engine = LocalEngine(program, segments, mse, sgd)
    (x, y) = batches(1, 8)[0]
    got = engine.evaluate(x, y)
    with torch.no_grad():
        want = mse(plain[1](plain[0](x)), y).item()
    assert abs(got - want) < 1e-12
    assert _held(segments) == 0


def _init(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _zero_worker(rank: int, world_size: int, directory: str) -> int:
    _init(rank, world_size)
    p, dp, m, steps = 2, 2, 4, 2
    # ZeRO-2; ZeRO-3 over gloo point-to-point (the eager plan); ZeRO-3 over shared memory, and
    # again with every forward recomputed before its backward
    for zero, shared_memory, recompute in (
        (2, True, False),
        (3, False, False),
        (3, True, False),
        (3, True, True),
    ):
        schedule = schedcc.get_schedule("1f1b")(p, m)
        program = schedcc.compile(schedule, data_parallel=dp, zero=zero, recompute=recompute)
        segments = models.mlp_segments(p, width=8, seed=1)
        oracle, plain = copy.deepcopy(segments), copy.deepcopy(segments)
        data = models.TeacherData(width=8, seed=2)
        global_batches = [data.batch(2 * m * dp, step) for step in range(steps)]
        replicas = [list(zip(x.chunk(dp), y.chunk(dp))) for x, y in global_batches]
        engine = Engine(
            program,
            segments,
            F.mse_loss,
            _optimizer,
            timeout=60,
            p2p="shm" if shared_memory else "gloo",
        )
        record: list = []
        grads: list = []
        _watch(engine.runtime, record, grads)
        losses = list(engine.train([r[rank // p] for r in replicas]))
        oracle_engine = LocalEngine(program, oracle, F.mse_loss, _optimizer)
        local = list(oracle_engine.train(replicas))
        reference = train_reference(plain, F.mse_loss, _optimizer, replicas)
        where = f"zero={zero} shm={shared_memory} recompute={recompute} rank {rank}"
        assert max(abs(a - b) for a, b in zip(losses, local)) < 1e-12, where
        assert max(abs(a - b) for a, b in zip(losses, reference)) < 1e-9, where
        mine = segments[engine.stage]
        full = _held([plain[engine.stage]])  # the stage's values, whole
        # each reduce-scatter is launched, its whole gradients held until it is waited (at the
        # chunk's next weight gradient, its Reshard or the Step), then only the shard's
        after_reduce = [held for op, held in grads if type(op) is ReduceGrads]
        assert after_reduce == [full] * (m * steps), (where, after_reduce)
        released = [held for op, held in grads if type(op) in (Reshard, OptimizerStep)]
        assert released == [0] * (steps * (1 + (zero == 3))), (where, released)
        assert engine.runtime._reducer.shards[0].grad is None, where  # stepped and cleared
        if zero == 3:
            assert _held([mine]) == 0, where  # between batches: only the shard
            assert engine.runtime.state.shards[0].numel() == full // dp, where
            before = [held for op, held in record if type(op) is Unshard]
            assert before == [0] * steps, (where, before)
            during = [held for op, held in record if type(op) is Reshard]
            assert during == [full] * steps, (where, during)
        with engine.unsharded(), oracle_engine.unsharded():
            for got, want, ref in zip(
                mine.parameters(),
                oracle[engine.stage].parameters(),
                plain[engine.stage].parameters(),
            ):
                assert torch.allclose(got, want, rtol=0, atol=1e-12), where
                assert torch.allclose(got, ref, rtol=0, atol=1e-9), where
    engine.save(directory)  # zero=3: each rank writes its shards
    dist.barrier()
    if rank == 0:  # the shards load whole into one local pipeline without ZeRO
        restored = models.mlp_segments(p, width=8, seed=9)
        single = schedcc.compile(schedcc.get_schedule("1f1b")(p, m))
        LocalEngine(single, restored, F.mse_loss, _optimizer).load(directory)
        for got, want in zip(restored, plain):
            for a, b in zip(got.parameters(), want.parameters()):
                assert torch.allclose(a, b, rtol=0, atol=1e-9)
    return 0


def test_distributed_zero_2_and_3_equal_local_and_non_pipelined_training(tmp_path):
    """On 4 gloo ranks (dp=2 x p=2, 1f1b), ZeRO-2 and ZeRO-3 train to the local backend's
    numbers (1e-12) and to non-pipelined training (1e-9); a reduce-scatter leaves a rank only
    its gradient shard; under ZeRO-3 a rank holds only its parameter shard (half the stage's
    values) between batches and before each Unshard, and its checkpoint loads whole locally."""
    assert spawn(_zero_worker, 4, (str(tmp_path / "ckpt"),), grace=60, threads=1) == 0


def _adam_engine(dp: int, zero: int, seed: int):
    torch.manual_seed(seed)
    segments = [
        torch.nn.Sequential(torch.nn.Linear(5, 5, dtype=torch.float64), torch.nn.Tanh())
        for _ in range(2)
    ]
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2), data_parallel=dp, zero=zero)
    engine = LocalEngine(program, segments, mse, lambda ps: torch.optim.Adam(ps, lr=0.01))
    return engine, segments


def test_zero3_checkpoints_reshard_to_zero_0_and_1_and_back(tmp_path):
    """A zero=3 dp=2 checkpoint (each rank saves its shard) loads at dp=1 without ZeRO with the
    trained weights whole, is saved again, loads at zero=1 and then back at zero=3 (Adam state
    re-sharded each time), and training on equals the uninterrupted zero=3 run."""
    data = batches(4, 8, width=5)
    whole, whole_segments = _adam_engine(2, 3, seed=0)
    list(whole.train(data))

    first, first_segments = _adam_engine(2, 3, seed=0)
    list(first.train(data[:2]))
    first.save(tmp_path / "a")
    single, single_segments = _adam_engine(1, 0, seed=5)
    single.load(tmp_path / "a")
    with first.unsharded():
        for a, b in zip(first_segments, single_segments):
            for x, y in zip(a.parameters(), b.parameters()):
                assert torch.equal(x, y)
    single.save(tmp_path / "b")
    one, _ = _adam_engine(2, 1, seed=6)
    one.load(tmp_path / "b")
    one.save(tmp_path / "c")
    again, again_segments = _adam_engine(2, 3, seed=7)
    again.load(tmp_path / "c")
    assert _held(again_segments) == 0  # loaded as shards
    list(again.train(data[2:]))

    with whole.unsharded(), again.unsharded():
        for a, b in zip(whole_segments, again_segments):
            for x, y in zip(a.parameters(), b.parameters()):
                torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
