"""collect: a user's order() that fails, returns a non-iterable or never ends is a typed error."""

from __future__ import annotations

import pytest

from schedcc import Forward, Schedule
from schedcc.passes.collect import collect, max_instructions
from schedcc.schedule import ScheduleCodeError


class _Forever(Schedule):
    chunks = "any"

    def order(self, stage):
        while True:
            yield Forward(0)


class _Raises(Schedule):
    def order(self, stage):
        if stage == 1:
            raise ValueError("stage one is special\nmore detail")
        yield Forward(0)


class _ReturnsInt(Schedule):
    def order(self, stage):
        return 3


class _NoOrder(Schedule):
    pass


def test_a_generator_that_never_ends_stops_at_the_limit():
    """An endless order() is refused after max_instructions, naming the stage and the limit."""
    schedule = _Forever(2, 4)
    limit = max_instructions(schedule)
    assert limit >= 64 * 4
    with pytest.raises(ScheduleCodeError, match=f"more than {limit} instructions for stage 0"):
        collect(schedule)


def test_the_limit_grows_with_the_shape():
    """The limit is proportional to microbatches x chunks (plus a constant)."""
    small, large = _Forever(2, 4), _Forever(2, 8, num_chunks=2, num_batches=3)
    assert max_instructions(large) - max_instructions(small) == 64 * (48 - 4)


def test_steps_raising_names_the_class_method_and_first_line():
    """order() raising is a one-line ScheduleCodeError: class, method, the error's first line."""
    with pytest.raises(ScheduleCodeError) as info:
        collect(_Raises(2, 1))
    assert str(info.value) == (
        "_Raises(p=2, m=1): _Raises.order(1) raised ValueError: stage one is special"
    )
    assert isinstance(info.value.__cause__, ValueError)


def test_steps_returning_a_non_iterable_says_so():
    """order() returning 3 is a ScheduleCodeError saying it is not iterable."""
    with pytest.raises(
        ScheduleCodeError, match=r"_ReturnsInt\.order\(0\) returned 3, which is not"
    ):
        collect(_ReturnsInt(1, 1))


def test_a_class_without_steps_says_so():
    """A Schedule subclass that does not define order() is a ScheduleCodeError, not a
    NotImplementedError."""
    with pytest.raises(ScheduleCodeError, match="_NoOrder does not define order"):
        collect(_NoOrder(1, 1))
