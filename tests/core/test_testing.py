"""schedcc.testing: shape strategies respect each schedule's rules, and check_schedule passes
every built-in and names the smallest failing shape of a broken schedule."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given

from schedcc import Backward, Forward, Schedule, ScheduleConfigError, get_schedule
from schedcc.schedules.one_f_one_b import OneFOneB
from schedcc.schedules.pipedream_2bw import PipeDream2BW
from schedcc.testing import ScheduleCheckError, Shape, check_schedule, schedules, shapes


class DropsLastBackward(Schedule):
    """GPipe that forgets the last backward of each batch once m >= 3 (a deliberate bug)."""

    name = "drops-last-backward"

    def check(self) -> None:
        if self.num_chunks != 1:
            raise ScheduleConfigError("drops-last-backward runs one chunk per stage")

    def order(self, stage):
        for batch in range(self.num_batches):
            microbatches = self.microbatches(batch)
            yield from (Forward(i) for i in microbatches)
            backwards = list(reversed(microbatches))
            if self.num_microbatches >= 3:
                backwards.pop()
            yield from (Backward(i) for i in backwards)


class RejectsEverything(Schedule):
    """A schedule whose constructor accepts no shape."""

    name = "rejects-everything"

    def check(self) -> None:
        raise ScheduleConfigError("rejects-everything accepts no shape")


def test_check_schedule_names_the_smallest_failing_shape():
    """A broken schedule fails with an AssertionError naming the shrunk shape p=1, m=3."""
    with pytest.raises(ScheduleCheckError) as info:
        check_schedule(DropsLastBackward, max_examples=50)
    error = info.value
    assert isinstance(error, AssertionError)
    assert error.shape == Shape(1, 3, 1, 1)
    assert "fails at p=1, m=3, v=1, batches=1" in str(error)
    assert "IncompleteScheduleError" in str(error)


def test_check_schedule_with_no_accepted_shape_is_a_config_error():
    """A schedule that rejects every shape within the bounds gets a ScheduleConfigError."""
    with pytest.raises(ScheduleConfigError, match="rejects every shape"):
        check_schedule(
            RejectsEverything, max_stages=2, max_microbatches=2, max_chunks=1, max_batches=1
        )


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "2bw"])
def test_check_schedule_numerics_passes_for_builtins(name):
    """numerics=True trains each built-in on the local backend and matches the reference."""
    check_schedule(
        get_schedule(name),
        numerics=True,
        max_examples=4,
        max_stages=3,
        max_microbatches=4,
        max_chunks=2,
        max_batches=2,
    )


def test_check_schedule_numerics_catches_a_wrong_backward(monkeypatch):
    """A runtime whose gradients are off by 0.1% fails the numerics check with the shape."""
    from schedcc.backends.runtime import grads

    backward = grads.backward_into_grads

    def skewed(output, grad_out, leaves=None):
        backward(output * 1.001, grad_out, leaves)

    monkeypatch.setattr(grads, "backward_into_grads", skewed)
    with pytest.raises(ScheduleCheckError, match="differs from non-pipelined training"):
        check_schedule(OneFOneB, numerics=True, max_examples=3, max_stages=2, max_microbatches=2)


@given(shape=shapes(OneFOneB))
def test_shapes_keep_one_chunk_for_schedules_without_chunks(shape):
    """shapes() keeps v = 1 for a schedule that rejects num_chunks = 2."""
    assert shape.num_chunks == 1


@given(shape=shapes(PipeDream2BW, max_stages=8, max_microbatches=4))
def test_shapes_are_accepted_by_the_constructor(shape):
    """Every shape shapes() draws is one the schedule's constructor accepts, within bounds."""
    assert shape.accepted_by(PipeDream2BW)
    assert 1 <= shape.num_stages <= 8
    assert 1 <= shape.num_microbatches <= 4
    assert 1 <= shape.num_batches <= 3


@given(schedule=schedules(OneFOneB, max_stages=3))
def test_schedules_builds_instances(schedule):
    """schedules() draws instances of the class at an accepted shape."""
    assert isinstance(schedule, OneFOneB)
    assert schedule.num_stages <= 3


def test_shape_prints_every_field():
    """A Shape prints as p, m, v and batches, as failure messages show it."""
    assert str(Shape(2, 8, 3, 1)) == "p=2, m=8, v=3, batches=1"


def test_importing_testing_does_not_import_torch():
    """schedcc.testing is usable without torch: importing it does not import torch."""
    code = "import sys, schedcc.testing; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


class OneChunkGPipe(Schedule):
    """README's GPipe: yields chunk 0 only, so it is written for one chunk per stage."""

    def order(self, stage):
        for batch in range(self.num_batches):
            mbs = self.microbatches(batch)
            yield from (Forward(i) for i in mbs)
            yield from (Backward(i) for i in reversed(mbs))


class BackwardChunksInOrder(Schedule):
    """Runs each microbatch's backwards chunk 0 first: right for v = 1 only, declared any."""

    chunks = "any"

    def order(self, stage):
        for batch in range(self.num_batches):
            mbs = self.microbatches(batch)
            for chunk in range(self.num_chunks):
                yield from (Forward(i, chunk=chunk) for i in mbs)
            for chunk in range(self.num_chunks):
                yield from (Backward(i, chunk=chunk) for i in reversed(mbs))


def test_check_schedule_passes_a_one_chunk_schedule():
    """check_schedule keeps v = 1 for a schedule that declares no chunks (README's GPipe)."""
    check_schedule(OneChunkGPipe, max_examples=20)


def test_check_schedule_finds_a_schedule_wrong_only_with_more_chunks():
    """A schedule declaring any chunk count but right only for v = 1 fails at a v > 1 shape."""
    with pytest.raises(ScheduleCheckError) as info:
        check_schedule(BackwardChunksInOrder, max_examples=50)
    assert info.value.shape.num_chunks > 1
