"""dualpipe-v: DeepSeek's and torch's DualPipeV order with overlapped pairs; it validates over the
shapes it accepts, trains exactly on the local and distributed backends, and keeps its
docstring's numbers."""

from __future__ import annotations

import pytest

import schedcc
from schedcc import (
    Backward,
    CostModel,
    Forward,
    IncompleteScheduleError,
    OverlappedBackward,
    ScheduleConfigError,
)


def _dualpipe_v(*shape, **kwargs):
    return schedcc.get_schedule("dualpipe-v")(*shape, **kwargs)


@pytest.mark.parametrize(("shape", "dp", "zero"), [((2, 4), 1, 0), ((3, 7), 1, 0), ((4, 9), 2, 1)])
def test_trains_like_non_pipelined(shape, dp, zero):
    """Full pipelines (warm-up, overlapped steady state, zero-bubble tail) train exactly."""
    pytest.importorskip("torch")
    from _models import batches, make_segments, mse, sgd

    from schedcc.backends.reference import assert_matches_reference

    schedule = _dualpipe_v(*shape, num_batches=2)
    program = schedcc.compile(schedule, data_parallel=dp, zero=zero)
    data = batches(4, dp * schedule.num_microbatches)
    segments = make_segments(schedule.num_segments)
    assert assert_matches_reference(program, segments, mse, sgd, data) < 1e-10


@pytest.mark.parametrize(("p", "m"), [(1, 2), (2, 4), (2, 9), (3, 6), (4, 8), (4, 13), (6, 12)])
def test_equals_torchs_dualpipev_order(p, m):
    """Each stage's order is torch's ScheduleDualPipeV's, overlapped pairs included."""
    pytest.importorskip("torch")
    from schedcc.interop.torch import torch_schedule

    theirs = torch_schedule("ScheduleDualPipeV", p, m, num_chunks=2)
    ours = _dualpipe_v(p, m)
    for stage in range(p):
        assert list(ours.order(stage)) == list(theirs.order(stage)), stage


@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)])
def test_memory_and_overlap_gain(p, m):
    """Every stage holds at most 2p + 1 chunk activations (DeepSeek's PP + 1, reached on stage
    0), and overlapping the pairs only shortens the run: with `overlap=1` (a pair costs F + B)
    the order takes exactly as long as with its pairs run as plain backwards."""
    program = schedcc.compile(_dualpipe_v(p, m))
    timeline = schedcc.simulate(program)
    assert max(timeline.peak_activations) == timeline.peak_activations[0] == 2 * p + 1
    ones = schedcc.simulate(program, CostModel(overlap=1.0)).makespan
    assert timeline.makespan < ones
    assert schedcc.simulate(program, CostModel(overlap=0.0)).makespan < timeline.makespan
    pairs = sum(type(op) is OverlappedBackward for ops in program.stages for op in ops)
    # per stage two per steady-state step and one per drain step, less stage p - 1's first
    assert pairs == sum(2 * (m - 2 * p + s + 1) + p - s - 1 for s in range(p)) - 1


def test_docstring_numbers():
    """The docstring's makespans (p = 4, m = 8): 49 with overlap, 54 without, 1F1B's 66."""
    program = schedcc.compile(_dualpipe_v(4, 8))
    assert schedcc.simulate(program).makespan == 49
    assert schedcc.simulate(program, CostModel(overlap=1.0)).makespan == 54
    one_f_one_b = schedcc.compile(schedcc.get_schedule("1f1b")(4, 8))
    assert schedcc.simulate(one_f_one_b, CostModel(forward=2.0, backward=4.0)).makespan == 66


def test_docstring_drawing_and_orders_are_the_schedule():
    """The drawing in the module docstring is `schedcc show`'s ascii timeline at 100 columns,
    line for line, and the per-stage orders printed there are what the schedule yields."""
    from schedcc.schedules import dualpipe_v

    schedule = _dualpipe_v(4, 8)
    timeline = schedcc.simulate(schedcc.compile(schedule))
    for line in timeline.to_ascii(width=86, color=False).splitlines()[1:]:
        assert f"    {line}\n" in dualpipe_v.__doc__
    drawn = " ".join(dualpipe_v.__doc__.split("stage 0:", 1)[1].split())
    for stage in range(4):
        assert " ".join(map(str, schedule.order(stage))) in drawn, stage


@pytest.mark.parametrize(("shape", "match"), [((4, 7), "at least 2p = 8"), ((2, 4, 3), "-v 2")])
def test_refuses_what_it_cannot_run(shape, match):
    """Fewer than 2p microbatches or other than two chunks: a config error that says the fix."""
    with pytest.raises(ScheduleConfigError, match=match):
        _dualpipe_v(*shape)


# -- full DualPipe: two model replicas, microbatches from both ends ------------------------------


def _dualpipe(*shape, **kwargs):
    return schedcc.get_schedule("dualpipe")(*shape, **kwargs)


def _masked_sum(out, y):
    """A `(loss_sum, count)` loss over the positive targets: counts differ between microbatches."""
    kept = y > 0
    return (((out - y) ** 2) * kept).sum(), kept.sum()


@pytest.mark.parametrize(
    ("shape", "dp", "zero", "summed"),
    [
        ((2, 4), 1, 0, False),
        ((4, 10), 1, 0, False),
        ((2, 6), 2, 1, False),
        ((2, 4), 2, 3, False),
        ((2, 4), 1, 0, True),
        ((2, 6), 2, 1, True),
    ],
)
def test_dualpipe_trains_like_non_pipelined(shape, dp, zero, summed):
    """Each stage trains both mirrored copies; their gradients are summed before the step, so the
    copies stay equal and both equal non-pipelined training of one model to 1e-10. Under a
    (loss_sum, count) loss whose counts differ from microbatch to microbatch (`summed`), each
    replica carries its own count down its segments and every step divides by their sum."""
    pytest.importorskip("torch")
    from _models import batches, make_segments, mse, sgd

    from schedcc.backends.reference import assert_matches_reference

    schedule = _dualpipe(*shape, num_batches=2)
    program = schedcc.compile(schedule, data_parallel=dp, zero=zero)
    parts = make_segments(schedule.num_stages)
    data = batches(4, dp * schedule.num_microbatches)
    loss = _masked_sum if summed else mse
    assert assert_matches_reference(program, parts + parts, loss, sgd, data) < 1e-10


def test_dualpipe_routes_and_replicas():
    """The first half of a batch runs segments 0..p-1 down the stages, the second half their
    copies p..2p-1 up from stage p - 1; each segment is tied to its copy (user ties joined)."""
    p, m = 4, 8
    schedule = _dualpipe(p, m)
    program = schedcc.compile(schedule, tied=[(0, 3)])
    assert program.tied == ((0, 3, 4, 7), (1, 5), (2, 6))
    for s, ops in enumerate(program.stages):
        for op in ops:
            if isinstance(op, schedcc.ir.Compute):
                k = schedule.segment_of(s, op.chunk)
                assert (k >= p) == (op.microbatch % m >= m // 2), (s, op)
    assert [schedule.placement(k)[0] for k in range(2 * p)] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_dualpipe_memory_and_speed():
    """Every stage holds at most p + 1 chunk activations (DeepSeek's PP + 1) and, with pairs
    overlapped, the run beats 1F1B on the same model and its own order without overlap."""
    for p, m in [(2, 4), (4, 8), (8, 16)]:
        program = schedcc.compile(_dualpipe(p, m))
        timeline = schedcc.simulate(program)
        assert max(timeline.peak_activations) == p + 1
        plain = schedcc.simulate(program, CostModel(overlap=1.0)).makespan
        one_f_one_b = schedcc.simulate(schedcc.compile(schedcc.get_schedule("1f1b")(p, m)))
        assert timeline.makespan < plain < one_f_one_b.makespan


@pytest.mark.parametrize("shape", [(3, 6), (4, 6), (2, 5), (2, 4, 1)])
def test_dualpipe_refuses_what_it_cannot_run(shape):
    """An odd p, an odd m, m < 2p or other than two chunks: a config error naming the fix."""
    with pytest.raises(ScheduleConfigError, match=r"dualpipe-v|-v 2"):
        _dualpipe(*shape)


def test_a_sum_count_loss_is_refused_where_a_stage_misses_a_replica():
    """A stage that holds no segment of a replica never learns that replica's count: a
    (loss_sum, count) loss is refused there, naming the stage and the replica."""
    from schedcc.backends.runtime.losses import LossBook, unseen_replica
    from schedcc.semantics.layout import Layout

    assert unseen_replica(Layout.of(_dualpipe(2, 4))) is None
    apart = Layout(((0, 1), (2, 3)), (0, 0, 1, 1), (0, 1, 0, 1), (0, 1), 2)  # a replica a stage
    why = unseen_replica(apart)
    assert why == "stage 0 holds no segment of model replica 1"
    book = LossBook(4, 1, replicas=(0, 1), unseen=why)
    torch = pytest.importorskip("torch")
    with pytest.raises(ScheduleConfigError, match="stage 0 holds no segment of model replica 1"):
        book.objective(0, (torch.tensor(1.0), 2), where="loss_fn on microbatch 0")


def test_dualpipe_docstring_drawing_and_orders_are_the_schedule():
    """The drawing in dualpipe's docstring is `schedcc show`'s at 100 columns, line for line, and
    the per-stage orders printed there are what the schedule yields."""
    from schedcc.schedules import dualpipe

    schedule = _dualpipe(4, 8)
    timeline = schedcc.simulate(schedcc.compile(schedule))
    assert (timeline.makespan, max(timeline.peak_activations)) == (24, 5)
    for line in timeline.to_ascii(width=86, color=False).splitlines()[1:]:
        assert f"    {line}\n" in dualpipe.__doc__
    drawn = " ".join(dualpipe.__doc__.split("stage 0:", 1)[1].split())
    for stage in range(4):
        assert " ".join(map(str, schedule.order(stage))) in drawn, stage


class _TwoReplicas(schedcc.Schedule):
    """gpipe over two model replicas in a V: microbatch i runs replica i % 2 (or `bad`)."""

    name = "two-replicas"
    chunks = (2,)
    num_replicas = 2

    def __init__(self, num_stages, num_microbatches, *, stray=False, bad=None):
        self.stray, self.bad = stray, bad
        super().__init__(num_stages, num_microbatches, 2)

    def placement(self, segment):
        p = self.num_stages
        return (segment, 0) if segment < p else (2 * p - 1 - segment, 1)

    def replica_of(self, microbatch):
        return self.bad if self.bad is not None else microbatch % 2

    def order(self, stage):
        m, p = self.num_microbatches, self.num_stages
        for i in range(m):
            yield Forward(i, chunk=i % 2)
        if self.stray and stage == p - 1:
            yield Forward(0, chunk=1)  # microbatch 0 runs replica 0, not segment p
        for i in reversed(range(m)):
            yield Backward(i, chunk=i % 2)


def test_a_schedule_of_its_own_can_hold_replicas():
    """Any schedule may hold replicas: gpipe in a V with odd microbatches running up trains
    exactly; a compute on another replica's segment, or a bad replica, is a typed error."""
    pytest.importorskip("torch")
    from _models import batches, make_segments, mse, sgd

    from schedcc.backends.reference import assert_matches_reference

    program = schedcc.compile(_TwoReplicas(2, 4))
    parts = make_segments(2)
    assert assert_matches_reference(program, parts + parts, mse, sgd, batches(2, 4)) < 1e-10
    with pytest.raises(IncompleteScheduleError, match="runs model replica 0, not segment 2"):
        schedcc.compile(_TwoReplicas(2, 4, stray=True))
    with pytest.raises(ScheduleConfigError, match=r"replica_of\(0\) = 2"):
        schedcc.compile(_TwoReplicas(2, 4, bad=2))


def test_replicas_must_divide_the_segments():
    """`num_replicas` must divide p*v: a config error names the rule."""

    class Three(_TwoReplicas):
        num_replicas = 3

    with pytest.raises(ScheduleConfigError, match="num_replicas must be a positive integer"):
        Three(2, 4)
