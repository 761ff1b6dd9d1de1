"""dualpipe-v: DeepSeek's and torch's DualPipeV order with overlapped pairs; it validates over the
shapes it accepts, trains exactly on the local and distributed backends, and keeps its
docstring's numbers."""

from __future__ import annotations

import pytest
from hypothesis import settings

import schedcc
from schedcc import CostModel, OverlappedBackward, ScheduleConfigError
from schedcc.testing import check_schedule


def _dualpipe_v(*shape, **kwargs):
    return schedcc.get_schedule("dualpipe-v")(*shape, **kwargs)


def test_registered_by_name():
    """dualpipe-v is found by name through the entry-point registry."""
    assert schedcc.get_schedule("dualpipe-v").name == "dualpipe-v"


def test_validates_over_the_shapes_it_accepts():
    """It compiles, validates and simulates over random shapes it accepts (m >= 2p, two chunks),
    with data parallelism and ZeRO-1 too."""
    cls = schedcc.get_schedule("dualpipe-v")
    examples = settings().max_examples
    check_schedule(cls, max_examples=examples, max_stages=6, max_microbatches=20, max_chunks=2)
    check_schedule(
        cls, max_examples=max(3, examples // 3), max_stages=3, max_microbatches=8, max_chunks=2,
        data_parallel=2, zero=1,
    )  # fmt: skip


def test_trains_like_non_pipelined_over_random_shapes():
    """On the local backend in float64 it equals non-pipelined training to 1e-10."""
    pytest.importorskip("torch")
    examples = max(2, settings().max_examples // 5)
    check_schedule(
        schedcc.get_schedule("dualpipe-v"), max_examples=examples, max_stages=3,
        max_microbatches=8, max_chunks=2, max_batches=2, numerics=True,
    )  # fmt: skip


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
        assert list(ours.steps(stage)) == list(theirs.steps(stage)), stage


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
        assert " ".join(map(str, schedule.steps(stage))) in drawn, stage


@pytest.mark.parametrize(("shape", "match"), [((4, 7), "at least 2p = 8"), ((2, 4, 3), "-v 2")])
def test_refuses_what_it_cannot_run(shape, match):
    """Fewer than 2p microbatches or other than two chunks: a config error that says the fix."""
    with pytest.raises(ScheduleConfigError, match=match):
        _dualpipe_v(*shape)
