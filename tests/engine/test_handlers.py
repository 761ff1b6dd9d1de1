"""Custom instruction handlers (`engine.register_handler`) and how overlapped pairs run: a
handler is called for every instruction of its kind, results stay exact, and every misuse is a
typed error naming the instruction."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _models import batches, make_segments, sgd

import schedcc
from schedcc import Backward, Forward, OverlappedBackward, ReduceGrads, ScheduleConfigError
from schedcc.backends.local import Engine
from schedcc.backends.run.launch import spawn
from schedcc.backends.runtime.losses import count_carriers
from schedcc.errors import RuntimeInstructionError
from schedcc.semantics import Layout


def _masked_sum(out, y):
    kept = y > 0  # a (loss_sum, count) loss: one pair per batch carries the count
    return (((out - y) ** 2) * kept).sum(), kept.sum()


def _pairs(program) -> list[str]:
    """Each overlapped pair of the program, as `F3 +B1.1`, in stage order."""
    return [
        f"{ops[pos - 1]} {op}"
        for ops in program.stages
        for pos, op in enumerate(ops)
        if type(op) is OverlappedBackward
    ]


def _engines(name, m, *, dp=1, loss_fn=F.mse_loss, num_batches=1):
    schedule = schedcc.get_schedule(name)(2, m, 2, num_batches)
    program = schedcc.compile(schedule, data_parallel=dp)
    parts = make_segments(schedule.num_segments // type(schedule).num_replicas)
    segments = parts * type(schedule).num_replicas  # dualpipe: both replicas, the same modules
    plain = copy.deepcopy(segments)
    return program, Engine(program, segments, loss_fn, sgd), Engine(program, plain, loss_fn, sgd)


def _largest_difference(a: Engine, b: Engine) -> float:
    return max(
        (p - q).abs().max().item()
        for x, y in zip(a.segments, b.segments)
        for p, q in zip(x.parameters(), y.parameters())
    )


@pytest.mark.parametrize(
    ("name", "dp", "loss_fn"),
    [
        ("dualpipe-v", 1, F.mse_loss),
        ("dualpipe-v", 2, _masked_sum),
        ("dualpipe", 1, F.mse_loss),
        ("dualpipe", 1, _masked_sum),
    ],
)
def test_a_pair_handler_is_called_for_every_pair_and_stays_exact(name, dp, loss_fn):
    """A handler registered for OverlappedBackward is called once for every overlapped pair
    of the program (every replica's), with the pair's two instructions, and training equals
    the engine without it to 1e-12 (which equals non-pipelined training)."""
    program, engine, oracle = _engines(name, 8, dp=dp, loss_fn=loss_fn, num_batches=2)
    seen, in_order = [], set()

    def pair(call):
        seen.append(str(call))
        if call.in_order:
            in_order.add(call.backward.microbatch)
        assert type(call.forward) is Forward
        assert call.backward is call.instruction
        assert call.modules is not None
        call.run_forward()
        call.run_backward()

    engine.register_handler(OverlappedBackward, pair)
    data = batches(4, 16 * dp)
    got, want = list(engine.train(data)), list(oracle.train(data))
    assert sorted(seen) == sorted(_pairs(program) * dp * 2)  # two runs of the program
    carriers = set(count_carriers(program, Layout.of(program.schedule)).values())
    paired = {
        op.microbatch for ops in program.stages for op in ops if type(op) is OverlappedBackward
    }
    assert in_order == carriers & paired  # the pairs whose backward carries a count
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-12
    assert _largest_difference(engine, oracle) < 1e-12


def test_a_pair_whose_backward_carries_a_count_says_so(monkeypatch):
    """A pair whose backward carries its batch's count tells the handler to keep the halves in
    order (the built-ins pair no such backward: here every backward claims to carry one)."""
    from schedcc.backends.runtime.losses import StageCounts

    monkeypatch.setattr(StageCounts, "carries", lambda self, microbatch: True)
    program, engine, oracle = _engines("dualpipe-v", 4, loss_fn=_masked_sum)
    flags = []

    def pair(call):
        flags.append(call.in_order)
        call.run()

    engine.register_handler(OverlappedBackward, pair)
    data = batches(1, 8)[0]
    assert abs(engine.train_step(*data) - oracle.train_step(*data)) < 1e-12
    assert flags == [True] * len(_pairs(program))


def _recording(kind):
    """A dualpipe-v engine (and its oracle) whose handler for `kind` records each call's
    `(stage, instruction)` in the returned list and runs it."""
    program, engine, oracle = _engines("dualpipe-v", 4)
    seen = []

    def record(call):
        seen.append((call.stage, call.instruction))
        call.run()

    engine.register_handler(kind, record)
    return program, engine, oracle, seen


def _of_kind(program, kind) -> list:
    return [(s, op) for s, ops in enumerate(program.stages) for op in ops if type(op) is kind]


def test_a_handler_for_any_compute_kind_wraps_its_work():
    """A Backward handler sees every plain Backward (not the overlapped ones), runs it with
    call.run(), and leaves the numbers as they were."""
    program, engine, oracle, seen = _recording(Backward)
    data = batches(1, 8)
    assert engine.train_step(*data[0]) == oracle.train_step(*data[0])
    assert sorted(seen, key=str) == sorted(_of_kind(program, Backward), key=str)
    assert _largest_difference(engine, oracle) == 0.0


def test_a_forward_handler_sees_every_forward_but_the_paired_ones():
    """Under dualpipe-v a Forward handler is called for each forward that no pair holds, in
    training, and for every forward of evaluation; numbers stay the same."""
    program, engine, oracle, seen = _recording(Forward)
    data = batches(1, 8)
    assert engine.train_step(*data[0]) == oracle.train_step(*data[0])
    paired = {(s, ops[pos - 1]) for s, ops in enumerate(program.stages) for pos, op in
              enumerate(ops) if type(op) is OverlappedBackward}  # fmt: skip
    alone = _of_kind(program, Forward)
    assert paired
    assert sorted(seen, key=str) == sorted(set(alone) - paired, key=str)
    seen.clear()
    assert engine.evaluate(*data[0]) == oracle.evaluate(*data[0])
    assert len(seen) == len(alone)


def test_a_handler_that_raises_names_the_pair():
    """A pair handler that raises is a RuntimeInstructionError naming the stage, the handler
    and the pair; the error of the segment's own forward passes through unchanged."""
    program, engine, _ = _engines("dualpipe-v", 4)

    def broken(call):
        raise ValueError("no overlap today")

    engine.register_handler(OverlappedBackward, broken)
    first = _pairs(program)[0]
    with pytest.raises(RuntimeInstructionError, match="no overlap today") as info:
        engine.train_step(*batches(1, 8)[0])
    assert "the handler" in str(info.value)
    assert "broken" in str(info.value)
    assert any(pair in str(info.value) for pair in _pairs(program)), first
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (lambda call: call.run_forward(), r"returned without calling run_backward\(\)"),
        (lambda call: None, r"without calling run_forward\(\) and run_backward\(\)"),
        (lambda call: call.run_backward(), r"run_backward\(\) before run_forward\(\)"),
        (
            lambda call: (call.run_forward(), call.run_forward()),
            r"called run_forward\(\) twice",
        ),
    ],
    ids=["no backward", "nothing", "backward first", "forward twice"],
)
def test_a_pair_handler_must_run_each_half_once_forward_first(body, words):
    """A pair handler that skips a half, runs one twice or runs the backward first is a
    RuntimeInstructionError naming the pair."""
    program, engine, _ = _engines("dualpipe-v", 4)
    engine.register_handler(OverlappedBackward, body)
    with pytest.raises(RuntimeInstructionError, match=words) as info:
        engine.train_step(*batches(1, 8)[0])
    assert any(pair in str(info.value) for pair in _pairs(program))


@pytest.mark.parametrize(
    ("kind", "fn", "words"),
    [
        (ReduceGrads, print, "takes a compute instruction class"),
        (OverlappedBackward(1), print, "takes a compute instruction class"),
        ("+B", print, "takes a compute instruction class"),
        (OverlappedBackward, "print", "fn must be a callable"),
    ],
)
def test_registering_for_an_unknown_kind_or_a_non_callable_is_refused(kind, fn, words):
    """An update kind, an instruction instead of its class, a string, or a non-callable: a
    ScheduleConfigError."""
    _, engine, _ = _engines("dualpipe-v", 4)
    with pytest.raises(ScheduleConfigError, match=words):
        engine.register_handler(kind, fn)


def _worker(rank: int, world_size: int) -> int:
    from datetime import timedelta

    import torch.distributed as dist

    from schedcc.backends.distributed.engine import Engine as DistEngine

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    for name, p2p in (("dualpipe-v", "shm"), ("dualpipe", "gloo")):
        program, local, _ = _engines(name, 6)
        schedule = program.schedule
        parts = make_segments(schedule.num_segments // type(schedule).num_replicas)
        segments = parts * type(schedule).num_replicas
        engine = DistEngine(program, segments, F.mse_loss, sgd, timeout=60, p2p=p2p)
        seen = []

        def pair(call, seen=seen):
            seen.append(str(call))
            call.run_forward()
            call.run_backward()

        engine.register_handler(OverlappedBackward, pair)
        data = batches(2, 12)
        got = [engine.train_step(*b) for b in data]
        want = [local.train_step(*b) for b in data]
        mine = _pairs_of_stage(program, engine.stage)
        assert sorted(seen) == sorted(mine * 2), (rank, name)
        assert mine, (rank, name)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-12, (rank, name, got, want)
        for c in range(2):
            k = schedule.segment_of(engine.stage, c)
            for a, b in zip(segments[k].parameters(), local.segments[k].parameters()):
                assert torch.allclose(a, b, rtol=0, atol=1e-12), (rank, name, k)
    dist.destroy_process_group()
    return 0


def _pairs_of_stage(program, stage: int) -> list[str]:
    ops = program.stages[stage]
    return [f"{ops[pos - 1]} {op}" for pos, op in enumerate(ops) if type(op) is OverlappedBackward]


@pytest.mark.distributed
def test_pair_handlers_on_two_gloo_ranks():
    """On 2 gloo ranks (dualpipe-v over shared memory, dualpipe over gloo point-to-point) each
    rank's handler is called for each of its stage's pairs, and training equals the local
    engine to 1e-12: the pair's forward output is sent only after the pair."""
    assert spawn(_worker, 2, grace=120, threads=1) == 0
