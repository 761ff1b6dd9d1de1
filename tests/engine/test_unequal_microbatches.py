"""Microbatches of unequal size: `train_step(..., microbatch_sizes=...)` trains exactly what
non-pipelined training of the whole batch trains (a mean loss: the mean over the samples; a
`(loss_sum, count)` loss: the total sum over the total count), on the local engine and on two
gloo ranks; bad sizes are refused before anything runs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _models import make_segments, sgd

import schedcc
from schedcc import ScheduleConfigError, TokenLoss
from schedcc.backends.local import Engine
from schedcc.backends.reference import Chain, assert_matches_reference
from schedcc.backends.run.launch import spawn

SIZES = [1, 3, 2, 6]
WIDTH = 3


def _data(size: int = 12, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, WIDTH, generator=gen, dtype=torch.float64)
    return x, torch.tanh(x.flip(-1)) * (x[:, :1] > -0.5)  # some rows all zero: ignored below


def _masked_sum(out, y):
    """A (loss_sum, count) loss whose counts differ between microbatches."""
    kept = y != 0
    return (((out - y) ** 2) * kept).sum(), kept.sum()


_token_loss = TokenLoss(
    lambda out, y: (((out - y) ** 2) * (y != 0)).sum(), lambda y: (y != 0).sum()
)


def _parts(out, y):
    """A dict loss: two named means over the microbatch, their sum optimised."""
    return {"mse": F.mse_loss(out, y), "l1": F.l1_loss(out, y)}


def _name(loss_fn) -> str:
    """A test id that is the same in every process (no addresses)."""
    return getattr(loss_fn, "__name__", type(loss_fn).__name__)


def _plain(loss_fn, out, y):
    """The non-pipelined objective of the whole batch: a mean, the sum over the count, or the
    parts' sum."""
    result = loss_fn(out, y)
    if isinstance(result, dict):
        return sum(result.values())
    return result[0] / result[1] if isinstance(result, tuple) else result


def _train_both(name, loss_fn, *, steps=3, dp=1, sizes=SIZES, p=2, v=1, recompute=False):
    """Train a pipelined copy with `sizes` and a non-pipelined copy on whole batches; return
    the largest difference in losses and weights."""
    schedule = schedcc.get_schedule(name)(p, len(sizes), v)
    program = schedcc.compile(schedule, data_parallel=dp, recompute=recompute)
    segments = make_segments(schedule.num_segments, width=WIDTH)
    piped, plain = copy.deepcopy(segments), Chain(copy.deepcopy(segments))
    engine = Engine(program, piped, loss_fn, sgd)
    opt = sgd(plain.parameters())
    worst = 0.0
    for step in range(steps):
        x, y = _data(dp * sum(sizes), seed=step)
        got = engine.train_step(x, y, microbatch_sizes=sizes)
        opt.zero_grad()
        want = _plain(loss_fn, plain(x), y)
        want.backward()
        opt.step()
        worst = max(worst, abs(got - want.item()))
    for mine, theirs in zip(piped, plain.segments):
        for a, b in zip(mine.parameters(), theirs.parameters()):
            worst = max(worst, (a - b).abs().max().item())
    return worst


@pytest.mark.parametrize("loss_fn", [F.mse_loss, _masked_sum, _token_loss], ids=_name)
@pytest.mark.parametrize(("name", "v"), [("1f1b", 1), ("interleaved-1f1b", 2), ("gpipe", 1)])
def test_unequal_sizes_equal_the_whole_batch(name, v, loss_fn):
    """Sizes [1, 3, 2, 6] with a mean loss, a (loss_sum, count) loss and a TokenLoss equal
    non-pipelined training of the whole 12-sample batch to 1e-10 (float64, three steps)."""
    assert _train_both(name, loss_fn, v=v) < 1e-10


@pytest.mark.parametrize("loss_fn", [F.mse_loss, _masked_sum, _parts], ids=_name)
def test_unequal_sizes_under_recompute(loss_fn):
    """With every forward recomputed (R replays it, recording no loss) sizes [1, 3, 2, 6]
    still train exactly; a dict loss's parts are weighed as its sum is."""
    assert _train_both("1f1b", loss_fn, recompute=True) < 1e-10


def test_a_dict_losss_parts_are_means_over_the_samples():
    """Each named part reported for unequal microbatches is the whole batch's mean."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    segments = make_segments(2, width=WIDTH)
    plain = Chain(copy.deepcopy(segments))
    engine = Engine(program, segments, _parts, sgd)
    x, y = _data(12)
    loss = engine.train_step(x, y, microbatch_sizes=SIZES)
    want = {name: value.item() for name, value in _parts(plain(x), y).items()}
    assert abs(loss - sum(want.values())) < 1e-12
    for name, value in want.items():
        assert abs(engine.last_metrics[name] - value) < 1e-12, name


@pytest.mark.parametrize("loss_fn", [F.mse_loss, _masked_sum], ids=_name)
def test_unequal_sizes_with_data_parallelism(loss_fn):
    """With dp = 2 each replica's local batch is split into [1, 3, 2, 6]; a step equals
    non-pipelined training of the 24-sample global batch."""
    assert _train_both("1f1b", loss_fn, dp=2) < 1e-10


def test_unequal_sizes_under_dualpipe_v():
    """dualpipe-v (overlapped pairs, two chunks) with unequal sizes trains exactly too."""
    assert _train_both("dualpipe-v", F.mse_loss, sizes=[1, 3, 2, 6, 1, 2, 5, 4], v=2) < 1e-10


def test_the_reference_trains_the_same_objective():
    """assert_matches_reference with microbatch_sizes agrees with the engine."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    data = [_data(12, seed=s) for s in range(2)]
    segments = make_segments(2, width=WIDTH)
    worst = assert_matches_reference(
        program, segments, F.mse_loss, sgd, data, microbatch_sizes=SIZES
    )
    assert worst < 1e-10


@pytest.mark.parametrize("name", ["2bw", "1f1b"])
def test_train_takes_sizes_per_batch(name):
    """train(batches, microbatch_sizes=...) takes one list per batch: under 2BW (weight delay,
    two batches a run) it equals the non-pipelined PipeDream-2BW rule on the same
    microbatches, and under 1F1B sizes that change per batch train as train_step does."""
    schedule = schedcc.get_schedule(name)(2, 4, num_batches=2)
    program = schedcc.compile(schedule)
    data = [_data(12, seed=s) for s in range(4)]
    segments = make_segments(2, width=WIDTH)
    if name == "2bw":
        from schedcc.backends.reference import train_reference

        plain = copy.deepcopy(segments)
        got = list(
            Engine(program, segments, F.mse_loss, sgd).train(data, microbatch_sizes=[SIZES] * 4)
        )
        want = train_reference(
            plain, F.mse_loss, sgd, data, weight_delay=1, batches_per_run=2,
            num_microbatches=4, microbatch_sizes=SIZES,
        )  # fmt: skip
        others = plain
    else:
        sizes = [SIZES, [6, 2, 3, 1], [3, 3, 3, 3], [1, 1, 1, 9]]
        one = schedcc.compile(schedcc.get_schedule(name)(2, 4))
        others = copy.deepcopy(segments)
        stepped = Engine(one, others, F.mse_loss, sgd)
        want = [stepped.train_step(*b, microbatch_sizes=n) for b, n in zip(data, sizes)]
        got = list(Engine(program, segments, F.mse_loss, sgd).train(data, microbatch_sizes=sizes))
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-10
    for a, b in zip(segments, others):
        for p, q in zip(a.parameters(), b.parameters()):
            assert (p - q).abs().max().item() < 1e-10


def test_train_refuses_too_few_or_bad_sizes():
    """Fewer size lists than batches, or a bad one, is a ScheduleConfigError naming the batch."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    engine = Engine(program, make_segments(2, width=WIDTH), F.mse_loss, sgd)
    data = [_data(12, seed=s) for s in range(2)]
    with pytest.raises(ScheduleConfigError, match="ran out at batch 1"):
        list(engine.train(data, microbatch_sizes=[SIZES]))
    with pytest.raises(ScheduleConfigError, match=r"batch 0: microbatch_sizes\[3\] is 0"):
        list(engine.train(data, microbatch_sizes=[[6, 3, 3, 0], SIZES]))


def test_sizes_differ_from_equal_microbatches_only_where_they_should():
    """Equal sizes given explicitly train what no sizes train (the mean of equal means)."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    x, y = _data(12)
    engines = [Engine(program, make_segments(2, width=WIDTH), F.mse_loss, sgd) for _ in "ab"]
    a = engines[0].train_step(x, y)
    b = engines[1].train_step(x, y, microbatch_sizes=[3, 3, 3, 3])
    assert abs(a - b) < 1e-14


@pytest.mark.parametrize(
    ("sizes", "words"),
    [
        ([1, 3, 2, 5], "sum to 11 but the batch holds 12"),
        ([0, 4, 2, 6], "microbatch_sizes[0] is 0"),
        ([-1, 5, 2, 6], "microbatch_sizes[0] is -1"),
        ([6, 6], "gives 2 sizes but the program splits a batch into m=4"),
        ([1, 3, 2, 6, 0], "gives 5 sizes"),
        ([1.0, 3, 2, 6], "microbatch_sizes[0] is 1.0, not an int"),
        (12, "must be a list of m=4 sample counts"),
    ],
)
def test_bad_sizes_are_refused_before_anything_runs(sizes, words):
    """Sizes not summing to the batch, zero or negative ones, another count than m and
    non-ints are a ScheduleConfigError naming the fix; no step is taken."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    segments = make_segments(2, width=WIDTH)
    before = [p.detach().clone() for s in segments for p in s.parameters()]
    engine = Engine(program, segments, F.mse_loss, sgd)
    with pytest.raises(ScheduleConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        engine.train_step(*_data(12), microbatch_sizes=sizes)
    after = [p.detach() for s in segments for p in s.parameters()]
    assert engine.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def _worker(rank: int, world_size: int) -> int:
    from datetime import timedelta

    import torch.distributed as dist

    from schedcc.backends.distributed.engine import Engine as DistEngine

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    for loss_fn in (F.mse_loss, _masked_sum):
        for p2p in ("shm", "nccl"):  # "nccl": the certain-shapes path, NCCL's code on gloo
            program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
            segments = make_segments(2, width=WIDTH)
            oracle = copy.deepcopy(segments)
            engine = DistEngine(program, segments, loss_fn, sgd, timeout=60, p2p=p2p)
            local = Engine(program, oracle, loss_fn, sgd)
            for step in range(3):
                sizes = [SIZES, [6, 2, 3, 1], SIZES][step]  # new shapes, then known ones
                x, y = _data(12, seed=step)
                got = engine.train_step(x, y, microbatch_sizes=sizes)
                want = local.train_step(x, y, microbatch_sizes=sizes)
                assert abs(got - want) < 1e-12, (rank, p2p, got, want)
            for a, b in zip(segments[rank].parameters(), oracle[rank].parameters()):
                assert torch.allclose(a, b, rtol=0, atol=1e-12), (rank, p2p)
    before = engine.steps
    for mine in ([SIZES, [6, 2, 3, 1]][rank], [SIZES, None][rank]):
        with pytest.raises(ScheduleConfigError, match="the ranks were given different"):
            engine.train_step(*_data(12), microbatch_sizes=mine)
    assert engine.steps == before
    dist.destroy_process_group()
    return 0


@pytest.mark.distributed
def test_unequal_sizes_on_two_gloo_ranks_equal_the_local_engine():
    """On 2 gloo ranks (shared memory, and NCCL's code path whose headers travel only for new
    shapes), sizes [1, 3, 2, 6] and [6, 2, 3, 1] with a mean and a (loss_sum, count) loss
    give the local engine's losses and weights to 1e-12; ranks given different sizes (or
    sizes on one rank only) all refuse the step with a ScheduleConfigError."""
    assert spawn(_worker, 2, grace=120, threads=1) == 0
