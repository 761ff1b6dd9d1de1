"""Data-parallel gradients in one contiguous buffer per chunk, reduced in buckets launched
asynchronously at `Reduce` and waited where the sums are needed ([Note: contiguous gradient
buckets] in `backends/runtime/zero.py`)."""

from __future__ import annotations

import copy

import pytest
import torch
from _models import batches, make_segments, mse, sgd
from _ranks import compare, init
from _tied_models import tied_segments

import schedcc
from schedcc.backends.local import Engine
from schedcc.backends.reference import assert_matches_reference
from schedcc.backends.run.launch import spawn
from schedcc.backends.runtime.zero import buckets
from schedcc.errors import ScheduleConfigError
from schedcc.ir import COMPUTE, WEIGHT_GRADIENT, ReduceGrads, Unshard

WIDTH = 8  # a segment: 64 + 8 float64 values (576 bytes)
SMALL = 64  # bytes per bucket: the bias alone, then the weight


def _trained(runtime) -> list[torch.nn.Parameter]:
    return [p for view in runtime._views for p in view.parameters()]


def _storages(tensors) -> dict[int, int]:
    """The distinct storages behind `tensors`: {address: bytes}."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _grad_storages(runtime) -> dict[int, int]:
    params = _trained(runtime) + list(runtime._reducer.shards)
    return _storages(p.grad for p in params if p.grad is not None)


def test_buckets_cut_at_parameter_boundaries_from_the_last_parameter():
    """Buckets run from the end of the buffer back, close once they hold `bucket_bytes`, keep
    a parameter larger than that alone, and the first covers the ZeRO padding."""
    assert buckets([4, 4, 4], 8, 64, 12) == [(4, 12), (0, 4)]
    assert buckets([4, 4, 4], 8, 32, 14) == [(8, 14), (4, 8), (0, 4)]
    assert buckets([2, 100, 2], 8, 64, 104) == [(2, 104), (0, 2)]
    assert buckets([4, 4, 4], 8, 2**20, 12) == [(0, 12)]
    assert buckets([], 8, 64, 0) == []


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bucket_bytes_must_be_a_positive_integer(value):
    """A bucket size that is not a positive integer is refused before anything runs."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4), data_parallel=2)
    with pytest.raises(ScheduleConfigError, match="bucket_bytes"):
        Engine(program, make_segments(2), mse, sgd, bucket_bytes=value)


def test_a_chunk_of_two_dtypes_is_refused_where_it_is_reduced():
    """One buffer per chunk needs one dtype: a segment mixing float32 and float64 is refused
    under data parallelism, naming the chunk, and trains as before without it."""
    segments = make_segments(2)
    segments[1][0].bias.data = segments[1][0].bias.data.float()
    schedule = schedcc.get_schedule("1f1b")(2, 4)
    with pytest.raises(ScheduleConfigError, match="chunk 0's parameters differ in dtype"):
        Engine(schedcc.compile(schedule, data_parallel=2), segments, mse, sgd)
    Engine(schedcc.compile(schedule), segments, mse, sgd)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_a_stage_without_parameters_reduces_nothing_and_trains_exactly(zero):
    """dp=2: a segment that is a lone activation has no buffer to reduce without ZeRO (and a
    padded one-element shard under it); training still equals non-pipelined training."""
    schedule = schedcc.get_schedule("1f1b")(2, 4, num_batches=2)
    program = schedcc.compile(schedule, data_parallel=2, zero=zero)
    segments = [make_segments(1)[0], torch.nn.Tanh()]
    assert_matches_reference(program, segments, mse, sgd, batches(2, 8))
    engine = Engine(program, segments, mse, sgd)
    list(engine.train(batches(2, 8)))
    launched = [e for e in engine.runtimes[0][1].reduction_events if e[0] == "launch"]
    assert len(launched) == {0: 0, 1: 2, 2: 8}[zero]  # per batch: none, one, one per backward


def _measured(runtime, record: list) -> None:
    """Append, after each instruction and inside each collective the runtime's gradient
    reduction calls, the bytes of the distinct storages behind its gradients (and the tensor
    being reduced)."""
    coll = runtime.collectives
    for name in ("all_reduce", "reduce_scatter"):
        real = getattr(coll, name)

        def measured(tensor, *args, real=real, name=name):
            held = _grad_storages(runtime) | _storages([tensor])
            record.append((name, sum(held.values())))
            return real(tensor, *args)

        setattr(coll, name, measured)
    run = runtime.run

    def ran(op):
        run(op)
        record.append((op, sum(_grad_storages(runtime).values())))

    runtime.run = ran


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_gradient_bytes_stay_within_the_buffer_and_the_shard(zero):
    """dp=2, p=2, several buckets per chunk: at every instruction and inside every collective,
    the gradients held (each `.grad`, the shard's, the tensor being summed) take no more than
    the chunk's whole gradients (ZeRO: padded) plus this rank's shard: no flattened copy."""
    schedule = schedcc.get_schedule("1f1b")(2, 4, num_batches=2)
    program = schedcc.compile(schedule, data_parallel=2, zero=zero)
    engine = Engine(program, make_segments(2, width=WIDTH), mse, sgd, bucket_bytes=SMALL)
    records = [[] for _ in engine.runtimes[0]]
    for runtime, record in zip(engine.runtimes[0], records):
        _measured(runtime, record)
    list(engine.train(batches(2, 8, width=WIDTH)))
    whole = (WIDTH * WIDTH + WIDTH) * 8
    bound = whole + (whole // 2 if zero else 0)
    for record in records:
        assert max(held for _, held in record) <= bound, record
        assert max(held for _, held in record) >= whole
        assert sum(type(name) is str for name, _ in record) >= 2 * len(buckets_of(engine))


def buckets_of(engine) -> list[tuple[int, int]]:
    return engine.runtimes[0][0]._reducer.grads[0].bounds


def test_every_grad_is_a_view_of_its_chunks_buffer():
    """Without ZeRO (dp=2), from a chunk's first weight gradient to the step every `.grad` of
    the chunk views one buffer, and the collectives sum slices of that buffer in place."""
    schedule = schedcc.get_schedule("interleaved-1f1b")(2, 4, num_chunks=2)
    program = schedcc.compile(schedule, data_parallel=2)
    engine = Engine(program, make_segments(4, width=WIDTH), mse, sgd, bucket_bytes=SMALL)
    runtime = engine.runtimes[0][0]
    seen: list = []
    coll = runtime.collectives
    real = coll.all_reduce

    def summed(tensor):
        seen.append(tensor.untyped_storage().data_ptr())
        real(tensor)

    coll.all_reduce = summed
    run = runtime.run
    views: list = []

    def ran(op):
        run(op)
        if type(op) is ReduceGrads:
            grads = [p.grad for p in runtime._views[op.chunk].parameters()]
            views.append(set(_storages(grads)))

    runtime.run = ran
    engine.train_step(*batches(1, 8, width=WIDTH)[0])
    assert [len(v) for v in views] == [1, 1]
    assert set(seen) == views[0] | views[1]
    assert len(seen) == sum(len(g.bounds) for g in runtime._reducer.grads) > 2


def test_a_reduction_is_launched_before_the_last_backward_and_waited_after_it():
    """Interleaved 1F1B (v=2, dp=2): chunk 1's reduction is launched at its `Reduce`, before
    the stage's last weight gradient (of chunk 0) has run, and its buckets are waited only at
    the step, after it; every bucket launched once and waited once, in launch order."""
    schedule = schedcc.get_schedule("interleaved-1f1b")(2, 4, num_chunks=2)
    program = schedcc.compile(schedule, data_parallel=2)
    engine = Engine(program, make_segments(4, width=WIDTH), mse, sgd, bucket_bytes=SMALL)
    records = [[] for _ in engine.runtimes[0]]
    for runtime, after in zip(engine.runtimes[0], records):
        run = runtime.run

        def ran(op, run=run, after=after, runtime=runtime):
            run(op)
            after.append((op, len(runtime.reduction_events)))

        runtime.run = ran
    engine.train_step(*batches(1, 8, width=WIDTH)[0])
    for runtime, after in zip(engine.runtimes[0], records):
        events = runtime.reduction_events
        last = max(n for op, n in after if isinstance(op, WEIGHT_GRADIENT))
        launched = events.index(("launch", 1, 0))
        waited = events.index(("wait", 1, 0))
        assert launched < last <= waited, (runtime.stage, events, after)
        bounds = [len(g.bounds) for g in runtime._reducer.grads]
        assert min(bounds) > 1
        for kind in ("launch", "wait"):
            mine = [(c, j) for k, c, j in events if k == kind]
            assert mine == [(c, j) for c in (1, 0) for j in range(bounds[c])], events


def test_zero3_gathers_ahead_and_waits_at_the_chunks_first_compute():
    """ZeRO-3 (dp=2, interleaved, v=2): each `Unshard`'s all-gather is launched there and
    waited by the chunk's next compute; the prefetched ones (placed a compute ahead) wait
    while another compute runs in between."""
    schedule = schedcc.get_schedule("interleaved-1f1b")(2, 4, num_chunks=2)
    program = schedcc.compile(schedule, data_parallel=2, zero=3)
    engine = Engine(program, make_segments(4, width=WIDTH), mse, sgd)
    records = [[] for _ in engine.runtimes[0]]
    for runtime, record in zip(engine.runtimes[0], records):
        run = runtime.run

        def ran(op, run=run, record=record, runtime=runtime):
            before = len(runtime.reduction_events)
            run(op)
            record.append((op, runtime.reduction_events[before:]))

        runtime.run = ran
    engine.train_step(*batches(1, 8, width=WIDTH)[0])
    overlapped = 0
    for record in records:
        for pos, (op, events) in enumerate(record):
            gathers = [e for e in events if e[0] == "gather"]
            assert gathers == ([("gather", op.chunk, 0)] if type(op) is Unshard else [])
            if type(op) is not Unshard:
                continue
            later = [(o, e) for o, e in record[pos + 1 :] if isinstance(o, COMPUTE)]
            first = next(i for i, (o, _) in enumerate(later) if o.chunk == op.chunk)
            assert ("gathered", op.chunk, 0) in later[first][1]
            assert all(("gathered", op.chunk, 0) not in e for _, e in later[:first])
            overlapped += first > 0
    assert overlapped > 0


def _train(program, segments, bucket_bytes, data, **kwargs):
    engine = Engine(program, segments, mse, sgd, bucket_bytes=bucket_bytes, **kwargs)
    losses = list(engine.train(data))
    with engine.unsharded():
        params = [p.detach().clone() for s in segments for p in s.parameters()]
    return losses, params


CASES = [
    ("1f1b", 1, 0, False),
    ("interleaved-1f1b", 2, 0, False),
    ("interleaved-1f1b", 2, 1, False),
    ("zb-h1", 1, 2, False),
    ("interleaved-1f1b", 2, 3, False),
    ("zb-v", 2, 0, True),
    ("zb-v", 2, 2, True),
    ("1f1b", 1, 3, True),
]


@pytest.mark.parametrize(("name", "v", "zero", "tied"), CASES)
def test_the_bucket_size_changes_no_bit(name, v, zero, tied):
    """dp=2 on the local backend, ZeRO 0-3, with a tie or not: a bucket per parameter gives
    bitwise the losses and weights of one bucket per chunk (the default size)."""
    schedule = schedcc.get_schedule(name)(2, 4, num_chunks=v, num_batches=2)
    k = schedule.num_segments
    ties = [(0, k - 1)] if tied else []
    program = schedcc.compile(schedule, data_parallel=2, zero=zero, tied=ties)
    segments = tied_segments(k, width=WIDTH) if tied else make_segments(k, width=WIDTH)
    data = batches(2, 8, width=WIDTH)
    small = _train(program, copy.deepcopy(segments), 8, data)
    default = _train(program, copy.deepcopy(segments), 2**25, data)
    assert small[0] == default[0]
    assert all(torch.equal(a, b) for a, b in zip(small[1], default[1]))


def test_buckets_under_a_weight_delay_and_clipping_change_no_bit():
    """2BW (weight stashing accumulates into the buffer's views) at dp=2 with a `Norm`
    clipping every step: tiny buckets and the default train bitwise alike."""
    schedule = schedcc.get_schedule("2bw")(2, 4, num_batches=3)
    program = schedcc.compile(schedule, data_parallel=2, grad_norm=True)
    segments = make_segments(2, width=WIDTH)
    data = batches(3, 8, width=WIDTH)
    small = _train(program, copy.deepcopy(segments), 8, data, max_grad_norm=0.5)
    default = _train(program, copy.deepcopy(segments), 2**25, data, max_grad_norm=0.5)
    assert small[0] == default[0]
    assert all(torch.equal(a, b) for a, b in zip(small[1], default[1]))


def _bucket_worker(rank: int, world_size: int) -> int:
    init(rank, world_size)
    compare(rank, "interleaved-1f1b", 2, 2, 1, 1, dp=2, zero=0, bucket_bytes=SMALL)
    for zero in (1, 2, 3):
        compare(rank, "1f1b", 2, 1, 1, 2, dp=2, zero=zero, bucket_bytes=SMALL)
    return 0


def test_distributed_buckets_equal_local_under_zero_0_to_3():
    """4 gloo ranks (dp=2 x p=2), several asynchronous buckets per chunk: ZeRO 0 (interleaved,
    two chunks) and ZeRO 1-3 train as the local backend does."""
    assert spawn(_bucket_worker, 4, grace=30, threads=1) == 0


@pytest.mark.parametrize("zero", [1, 2])
def test_a_gather_before_its_chunks_reduce_keeps_the_accumulated_gradients(zero):
    """`F0 F1 B1 B0 Gather Reduce Step Gather` (dp = 2): the validator accepts the early Gather
    (the shards are unchanged), and the gradients the backwards accumulated in the buffer are
    still there for the Reduce after it."""
    from schedcc.ir import GatherParams

    program = schedcc.compile(schedcc.get_schedule("gpipe")(1, 2), data_parallel=2, zero=zero)
    ops = list(program.stages[0])
    at = max(n for n, op in enumerate(ops) if type(op) is ReduceGrads)
    early = program.evolve(stages=((*ops[:at], GatherParams(0), *ops[at:]),))
    schedcc.validate(early)
    data = batches(2, 4)
    assert assert_matches_reference(early, make_segments(1), mse, sgd, data) < 1e-12
