"""The Schedule base class: argument checks, placement and derived shapes."""

from __future__ import annotations

import pytest
from _orders import OrderSchedule

from schedcc import Forward, Schedule, ScheduleConfigError, get_schedule
from schedcc.registry import build_schedule
from schedcc.schedule import ScheduleCodeError


class _Plain(Schedule):
    chunks = "any"

    def order(self, stage):
        yield Forward(0)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"num_stages": 0, "num_microbatches": 1}, "num_stages"),
        ({"num_stages": 2, "num_microbatches": -1}, "num_microbatches"),
        ({"num_stages": 2, "num_microbatches": 2, "num_chunks": 0}, "num_chunks"),
        ({"num_stages": 2, "num_microbatches": 2, "num_batches": 0}, "num_batches"),
        ({"num_stages": 2.0, "num_microbatches": 2}, "num_stages"),
        ({"num_stages": True, "num_microbatches": 2}, "num_stages"),
        ({"num_stages": 2, "num_microbatches": "4"}, "num_microbatches"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, named):
    """A bad shape raises ScheduleConfigError (a ValueError) naming the argument and the rule."""
    with pytest.raises(ScheduleConfigError, match=f"{named} must be a positive integer"):
        _Plain(**kwargs)
    with pytest.raises(ValueError, match=named):
        _Plain(**kwargs)


def test_schedule_own_rule_is_checked_before_compiling():
    """A schedule's `check` runs in the constructor: 1F1B rejects virtual stages by name."""
    with pytest.raises(ScheduleConfigError, match="num_chunks=2"):
        get_schedule("1f1b")(4, 8, num_chunks=2)


def test_default_placement_is_looped():
    """Segment k sits on stage k % p as chunk k // p unless a schedule overrides placement."""
    schedule = _Plain(3, 1, num_chunks=2)
    assert schedule.segment_table() == [[0, 3], [1, 4], [2, 5]]
    assert schedule.segment_of(1, 1) == 4
    assert schedule.num_segments == 6


def test_vshape_placement_override():
    """A V-shape placement folds the odd chunks back, so the last stage holds segments p-1, p."""
    schedule = OrderSchedule(3, 1, num_chunks=2, vshape=True)
    assert schedule.segment_table() == [[0, 5], [1, 4], [2, 3]]


def test_placement_must_be_one_to_one():
    """A placement that maps two segments to one (stage, chunk) is a ScheduleConfigError."""

    class Collide(_Plain):
        def placement(self, segment):
            return 0, 0

    with pytest.raises(ScheduleConfigError, match=r"placement\(1\) = \(0, 0\)"):
        Collide(2, 1)


def test_microbatches_are_global_per_batch():
    """Batch b owns microbatches b*m .. (b+1)*m - 1, and batch_of inverts it."""
    schedule = _Plain(2, 4, num_batches=3)
    assert schedule.microbatches(2) == range(8, 12)
    assert schedule.num_microbatches_total == 12
    assert [schedule.batch_of(i) for i in (0, 3, 4, 11)] == [0, 0, 1, 2]
    assert repr(schedule) == "_Plain(p=2, m=4, batches=3)"


def test_order_must_be_written():
    """The base class's order() says the subclass must define it."""
    with pytest.raises(NotImplementedError, match="must define order"):
        Schedule(1, 1).order(0)


class _CheckRaises(_Plain):
    def check(self):
        raise KeyError("num_chunks")


class _PlacementRaises(_Plain):
    def placement(self, segment):
        raise IndexError("segment out of range")


class _BadDelay(_Plain):
    weight_delay = "1"


class _TwoArgs(_Plain):
    def __init__(self, stages, microbatches):
        super().__init__(stages, microbatches)


def test_check_raising_another_error_is_a_code_error():
    """check() raising something other than ScheduleConfigError: ScheduleCodeError naming it."""
    with pytest.raises(ScheduleCodeError, match=r"_CheckRaises\.check\(\) raised KeyError"):
        _CheckRaises(2, 2)


def test_placement_raising_is_a_code_error():
    """placement() raising is a ScheduleCodeError naming the segment."""
    with pytest.raises(ScheduleCodeError, match=r"placement\(0\) raised IndexError"):
        _PlacementRaises(2, 2)


def test_weight_delay_must_be_a_non_negative_int():
    """A weight_delay that is not an int >= 0 is a ScheduleConfigError naming it."""
    with pytest.raises(ScheduleConfigError, match="weight_delay"):
        _BadDelay(2, 2)


def test_build_schedule_names_a_constructor_with_another_signature():
    """build_schedule turns a TypeError from the constructor into a one-line ScheduleCodeError."""
    with pytest.raises(ScheduleCodeError, match=r"_TwoArgs\.__init__\(\) raised TypeError") as info:
        build_schedule(_TwoArgs, 2, 2)
    assert "num_stages, num_microbatches, num_chunks=1, num_batches=1" in str(info.value)
    assert len(str(info.value).splitlines()) == 1


def test_build_schedule_keeps_the_class_default_chunks():
    """num_chunks=None keeps the class's own default: ZB-V gets two chunks."""
    assert build_schedule(get_schedule("zb-v"), 4, 8).num_chunks == 2
    assert build_schedule(_Plain, 2, 2, num_chunks=3, num_batches=2).num_batches == 2
