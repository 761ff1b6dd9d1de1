"""dualpipe-v and dualpipe on the distributed backend (2 forked processes, gloo on 127.0.0.1):
overlapped pairs run as forward then backward on each rank; under dualpipe microbatches enter at
both ends, each rank trains both of its mirrored segments and the copies' gradients are summed
across the ranks. Training equals the local backend exactly (which equals non-pipelined training,
tests/schedules/test_dualpipe.py)."""

from __future__ import annotations

import copy
from itertools import pairwise

import torch
import torch.nn.functional as F
from _ranks import compare as compare_built_in
from _ranks import init, optimizer

import schedcc
from schedcc.backends.distributed.engine import Engine
from schedcc.backends.local import Engine as LocalEngine
from schedcc.backends.run import models
from schedcc.backends.run.launch import spawn
from schedcc.ir import Compute, Forward, OverlappedBackward


def _masked_sum(out, y):
    kept = y > 0  # a (loss_sum, count) loss whose counts differ between microbatches
    return (((out - y) ** 2) * kept).sum(), kept.sum()


def _compare(rank: int, m: int, batches_per_run: int, loss_fn=F.mse_loss, **kwargs) -> None:
    schedule = schedcc.get_schedule("dualpipe")(2, m, num_batches=batches_per_run)
    program = schedcc.compile(schedule)
    parts = models.mlp_segments(2, width=8, seed=1)
    segments = parts + parts  # the same modules: each stage holds both, mirrored
    oracle = copy.deepcopy(segments)
    data = models.TeacherData(width=8, seed=2)
    batches = [data.batch(2 * m, step) for step in range(2 * batches_per_run)]
    engine = Engine(program, segments, loss_fn, optimizer, timeout=60, **kwargs)
    collectives = _counted(engine)
    losses = list(engine.train(batches))
    tied = sum(type(op).__name__ == "ReduceTied" for op in program.stages[engine.stage])
    assert len(collectives) == tied * len(batches) // batches_per_run  # one a tied group
    expected = list(LocalEngine(program, oracle, loss_fn, optimizer).train(batches))
    where = f"{schedule!r} rank {rank}"
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12, (where, losses, expected)
    assert engine.evaluate(*batches[0]) == LocalEngine(
        program, copy.deepcopy(oracle), loss_fn, optimizer
    ).evaluate(*batches[0]), where
    predicted = engine.predict(batches[0][0])  # both replicas' outputs, on segment 2p-1's stage
    if engine.stage == schedule.placement(schedule.num_segments - 1)[0]:
        want = LocalEngine(program, copy.deepcopy(oracle), loss_fn, optimizer).predict(
            batches[0][0]
        )
        assert torch.allclose(predicted, want, rtol=0, atol=1e-12), where
    else:
        assert predicted is None, where
    _check_pairs_timed_as_read(engine.trace_events())
    for c in range(2):
        k = schedule.segment_of(engine.stage, c)
        for got, want in zip(segments[k].parameters(), oracle[k].parameters()):
            assert torch.allclose(got, want, rtol=0, atol=1e-12), (where, k)


def _check_pairs_timed_as_read(events) -> None:
    """What `CostModel.from_trace` reads a run's pairs by ([Note: a measured pair]): each
    overlapped backward's event directly follows its forward's on the stage, and that forward
    is a marker timed within the pair's event, which runs both halves."""
    computes = [e for e in events if isinstance(e[1], Compute)]
    pairs = [(a, b) for a, b in pairwise(computes) if isinstance(b[1], OverlappedBackward)]
    assert pairs
    for (_, forward, f_start, f_end), (_, _, b_start, b_end) in pairs:
        assert isinstance(forward, Forward)
        assert f_end <= b_start
        assert f_end - f_start < b_end - b_start


def _counted(engine) -> list[int]:
    """The tied groups `engine`'s `ReduceTied`s sum over, one entry a collective they launch
    (every parameter of a replica is tied: one collective a group, not one a parameter)."""
    calls, runtime = [], engine.runtime
    reduce = runtime._tie_reduce

    def counting(group, tensor):
        calls.append(group)
        reduce(group, tensor)

    runtime._tie_reduce = counting
    return calls


def _worker(rank: int, world_size: int) -> int:
    init(rank, world_size)
    compare_built_in(rank, "dualpipe-v", 2, 2, 1, 2)
    compare_built_in(rank, "dualpipe-v", 2, 2, 2, 2, linked=False, p2p="gloo")
    _compare(rank, 4, 1)
    _compare(rank, 6, 2, p2p="gloo")
    _compare(rank, 4, 2, loss_fn=_masked_sum)
    return 0


def test_dualpipe_v_and_dualpipe_on_two_ranks_equal_local():
    """dualpipe-v (p = 2, m = 4, one and two batches per run) and dualpipe (m = 4; m = 6, two
    batches per run, over gloo point-to-point; m = 4 with a (loss_sum, count) loss) equal the
    local backend's losses, weights and predictions (dualpipe's, gathered from both replicas'
    last stages) to 1e-12 on every rank, over shared memory and over gloo."""
    assert spawn(_worker, 2, grace=90, threads=1) == 0
