"""Tied parameters on the local backend: a model whose last segment reuses the first segment's
weight trains exactly like the non-pipelined tied model (Adam, float64), on every built-in
schedule, with data parallelism and ZeRO; a program that does not tie them is refused before
anything changes; checkpoints keep the copies equal."""

from __future__ import annotations

import copy

import pytest
import torch
from _orders import random_orders
from _tied_models import adam, batches, mse, tied_segments
from hypothesis import given

import schedcc
from schedcc.backends.local import Engine
from schedcc.backends.reference import train_reference
from schedcc.errors import ScheduleConfigError

SCHEDULES = [
    ("gpipe", {}),
    ("1f1b", {}),
    ("interleaved-1f1b", {"num_chunks": 2}),
    ("zb-h1", {}),
    ("zb-v", {"num_chunks": 2}),
    ("2bw", {}),
]


def _train_and_compare(program, segments, data, *, atol=1e-10):
    """Train `program` on the local backend and the reference on copies of `segments`; every
    loss, every segment's parameters and every stage's copy of the tied weight agree."""
    schedule = program.schedule
    piped, plain = copy.deepcopy(segments), copy.deepcopy(segments)
    engine = Engine(program, piped, mse, adam)
    losses = list(engine.train(data))
    expected = train_reference(
        plain,
        mse,
        adam,
        data,
        weight_delay=schedule.weight_delay,
        batches_per_run=schedule.num_batches,
    )
    assert losses == pytest.approx(expected, abs=atol, rel=atol)
    with engine.unsharded():  # ZeRO-3 holds only shards between runs
        _compare_weights(engine, piped, plain, atol)
    return engine


def _compare_weights(engine, piped, plain, atol) -> None:
    for k, (mine, theirs) in enumerate(zip(piped, plain)):
        for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
            assert torch.allclose(p, q, atol=atol, rtol=atol), (k, name)
    tied = plain[0].weight
    for r, runtimes in enumerate(engine.runtimes):
        trained = [p for rt in runtimes for view in rt._views for p in view.parameters()]
        if r == 0:  # the caller's Parameter: trained by one stage, the others train copies
            assert sum(p is piped[0].weight for p in trained) == 1
        copies = [p for rt in runtimes for _, held in rt.ties.groups[0] for p in held]
        assert len(copies) == 2
        assert len({id(p) for p in copies}) == 2
        for p in copies:
            assert torch.allclose(p, tied, atol=atol, rtol=atol)


@pytest.mark.parametrize(("name", "kwargs"), SCHEDULES)
@pytest.mark.parametrize(("dp", "zero"), [(1, 0), (2, 0), (2, 1), (1, 2)])
def test_a_tied_model_trains_like_non_pipelined(name, kwargs, dp, zero):
    """Adam on the tied model, three batches in one run of the program: equal to non-pipelined
    training of the tied model to 1e-10, the caller's modules hold the weights and every
    private copy of the tied weight equals them."""
    schedule = schedcc.get_schedule(name)(2, 4, num_batches=3, **kwargs)
    last = schedule.num_segments - 1
    program = schedcc.compile(schedule, tied=[(0, last)], data_parallel=dp, zero=zero)
    _train_and_compare(program, tied_segments(schedule.num_segments), batches(3, 8 * dp))


@pytest.mark.parametrize(("name", "kwargs"), [s for s in SCHEDULES if s[0] != "2bw"])
def test_a_tied_model_trains_like_non_pipelined_under_zero_3(name, kwargs):
    """ZeRO-3 at dp = 2: a tied chunk stays whole until its ReduceTied has summed the copies'
    whole gradients and its reduce-scatter has run (before the step); then every copy's shard
    takes the same update, and training equals the non-pipelined tied model to 1e-10 (zb-v
    holds both copies on stage 0)."""
    schedule = schedcc.get_schedule(name)(2, 4, num_batches=2, **kwargs)
    last = schedule.num_segments - 1
    program = schedcc.compile(schedule, tied=[(0, last)], data_parallel=2, zero=3)
    _train_and_compare(program, tied_segments(schedule.num_segments), batches(2, 16))


@pytest.mark.parametrize(("name", "kwargs"), [s for s in SCHEDULES if s[0] != "2bw"])
def test_a_tied_model_trains_like_non_pipelined_over_several_runs(name, kwargs):
    """One batch per run, three runs (the copies stay equal across runs)."""
    schedule = schedcc.get_schedule(name)(3, 3, **kwargs)
    program = schedcc.compile(schedule, tied=[(0, schedule.num_segments - 1)])
    _train_and_compare(program, tied_segments(schedule.num_segments), batches(3, 6))


def test_a_program_that_does_not_tie_shared_segments_is_refused_before_anything_changes():
    """Segments 0 and 3 share a Parameter; a program without `tied` (or tying others) is refused
    with the parameter, the segments and the fix, and no weight changes."""
    segments = tied_segments(4)
    before = [copy.deepcopy(s.state_dict()) for s in segments]
    schedule = schedcc.get_schedule("1f1b")(4, 4)
    for tied in ((), [(1, 2)]):
        with pytest.raises(ScheduleConfigError) as info:
            Engine(schedcc.compile(schedule, tied=tied), segments, mse, adam)
        message = str(info.value)
        assert "parameter 'weight' of segment 0" in message
        assert "segments [0, 3]" in message
        assert "schedcc.compile(..., tied=[(0, 3)" in message
    for segment, state in zip(segments, before):
        for key, value in segment.state_dict().items():
            assert torch.equal(value, state[key])


def test_a_tied_group_that_shares_nothing_is_refused():
    """Tying segments that hold no common Parameter object is a mistake (e.g. a deepcopy)."""
    segments = tied_segments(4)
    segments[3] = copy.deepcopy(segments[3])
    program = schedcc.compile(schedcc.get_schedule("1f1b")(4, 4), tied=[(0, 3)])
    with pytest.raises(ScheduleConfigError, match=r"share no Parameter object"):
        Engine(program, segments, mse, adam)


@pytest.mark.parametrize(("name", "kwargs"), [("1f1b", {}), ("zb-v", {"num_chunks": 2})])
@pytest.mark.parametrize("dp", [1, 2])
def test_a_checkpoint_keeps_tied_copies_equal(tmp_path, name, kwargs, dp):
    """Save after one batch, load into an engine built on other weights: it trains on like the
    engine that saved (its private copies are refreshed from the checkpoint)."""
    schedule = schedcc.get_schedule(name)(2, 4, **kwargs)
    program = schedcc.compile(schedule, tied=[(0, schedule.num_segments - 1)], data_parallel=dp)
    data = batches(3, 8 * dp)
    first = Engine(program, tied_segments(schedule.num_segments), mse, adam)
    next(iter(first.train(data[:1])))
    first.save(tmp_path)
    expected = list(first.train(data[1:]))
    second = Engine(program, tied_segments(schedule.num_segments, seed=5), mse, adam)
    second.load(tmp_path)
    assert list(second.train(data[1:])) == expected
    for mine, theirs in zip(second.segments, first.segments):
        for p, q in zip(mine.parameters(), theirs.parameters()):
            assert torch.equal(p, q)
    for a, b in zip(second.runtimes[0], first.runtimes[0]):
        for view_a, view_b in zip(a._views, b._views):
            for p, q in zip(view_a.parameters(), view_b.parameters()):
                assert torch.equal(p, q)


@given(random_orders(max_stages=4, max_microbatches=4, max_chunks=2))
def test_random_orders_with_a_tie_train_exactly(schedule):
    """Every dependency-respecting compute order with its first and last segment tied compiles,
    validates and trains like the non-pipelined tied model."""
    n = schedule.num_segments
    if n < 2:
        return
    program = schedcc.compile(schedule, tied=[(0, n - 1)])
    m, runs = schedule.num_microbatches, schedule.num_batches
    _train_and_compare(program, tied_segments(n), batches(runs, 2 * m))


class _Switched(torch.nn.Module):
    """A tied segment that uses its weight only while `uses` is true (else passes `x` on),
    times a scale of its own (so a gradient flows either way)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.uses = inner, True
        self.scale = torch.nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.inner(x) if self.uses else x) * self.scale


@pytest.mark.parametrize(
    ("used", "reads"),
    [((True, True), 0), ((True, False), 1), ((False, False), 2)],
    ids=["both-copies", "embedding-only", "neither"],
)
def test_a_tie_reads_the_host_only_where_no_copy_here_has_a_gradient(used, reads):
    """[Note: a tie's gradient known here]: a stage whose copy of the tie has a gradient knows
    the tie has one and reads nothing; a stage whose copy has none reads the summed count (one
    read a stage). Counted on unread-loss steady steps, and each way trains like the
    non-pipelined model: the unused head's copy takes the embedding's gradient, and a tie no
    copy uses keeps no gradient (Adam leaves it as it was)."""
    from schedcc.backends.runtime.syncs import HostSyncs

    schedule = schedcc.get_schedule("1f1b")(2, 4)
    program = schedcc.compile(schedule, tied=[(0, 1)])
    embed, head = tied_segments(2)
    segments = [_Switched(embed), _Switched(head)]
    segments[0].uses, segments[1].uses = used
    piped, plain = copy.deepcopy(segments), copy.deepcopy(segments)
    engine = Engine(program, piped, mse, adam)
    data = batches(4, 8)
    first = piped[0].inner.weight.detach().clone()
    losses = [engine.train_step(*data[0], read_loss=False).item()]
    counts = []
    for x, y in data[1:]:
        before = HostSyncs.count
        losses.append(engine.train_step(x, y, read_loss=False))
        counts.append(HostSyncs.count - before)
    assert counts == [reads] * 3
    expected = train_reference(plain, mse, adam, data)
    assert [float(t) for t in losses] == pytest.approx(expected, abs=1e-10, rel=1e-10)
    for mine, theirs in zip(piped, plain):
        for p, q in zip(mine.parameters(), theirs.parameters()):
            assert torch.allclose(p, q, atol=1e-10, rtol=1e-10)
    assert torch.equal(piped[0].inner.weight, first) == (used == (False, False))
