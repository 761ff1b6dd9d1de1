"""ZB-H1 and ZB-V: they validate over many shapes, keep the paper's numbers, and train exactly."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import schedcc
from schedcc import ScheduleConfigError
from schedcc.schedules.zb_h1 import ZBH1
from schedcc.schedules.zb_v import ZBV
from schedcc.simulate import CostModel

UNIT = CostModel(forward=1.0, backward=2.0, backward_input=1.0, backward_weight=1.0)


def _timeline(schedule, costs=UNIT):
    return schedcc.simulate(schedcc.compile(schedule), costs)


@given(p=st.integers(1, 6), m=st.integers(1, 12), batches=st.integers(1, 2), dp=st.integers(1, 2))
def test_zb_h1_validates(p, m, batches, dp):
    """ZB-H1 compiles to a valid program for every shape, with data parallelism too."""
    schedcc.compile(ZBH1(p, m, num_batches=batches), data_parallel=dp)


@given(p=st.integers(1, 6), m=st.integers(1, 14), batches=st.integers(1, 2), dp=st.integers(1, 2))
def test_zb_v_validates(p, m, batches, dp):
    """ZB-V compiles to a valid program for every shape, with data parallelism too."""
    schedcc.compile(ZBV(p, m, num_chunks=2, num_batches=batches), data_parallel=dp)


def test_zb_v_defaults_to_two_chunks():
    """ZBV(p, m) means two chunks per stage, the only count it runs."""
    assert ZBV(4, 8).num_chunks == 2


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 4), (4, 8), (4, 13), (6, 7), (8, 16)])
def test_zb_h1_bubble_is_the_papers(p, m):
    """With F = I = W = 1 and m >= p, the makespan is m(F+I+W) + (p-1)(F+I-W): 3m + p - 1."""
    timeline = _timeline(ZBH1(p, m))
    assert timeline.makespan == 3 * m + p - 1
    assert timeline.idle == (p - 1.0,) * p


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 16)])
def test_zb_h1_bubble_is_a_third_of_1f1b(p, m):
    """ZB-H1's idle time per stage is a third of 1F1B's (B = I + W) at the same peak memory:
    a microbatch is held from F to W, so every stage holds p, as 1F1B's stage 0 does."""
    zb = _timeline(ZBH1(p, m))
    one_f_one_b = _timeline(schedcc.get_schedule("1f1b")(p, m))
    assert [3 * idle for idle in zb.idle] == list(one_f_one_b.idle)
    assert max(zb.peak_activations) == max(one_f_one_b.peak_activations)
    assert zb.peak_activations == (min(p, m),) * p


@pytest.mark.parametrize(
    ("forward", "backward_input", "backward_weight"),
    [(2.0, 2.0, 1.0), (3.0, 2.0, 2.0), (2.0, 3.0, 1.5), (1.0, 1.0, 0.5)],
)
def test_zb_h1_formula_with_other_costs(forward, backward_input, backward_weight):
    """For W <= min(F, I) the makespan stays m(F+I+W) + (p-1)(F+I-W), the paper's ZB-H1 bubble."""
    p, m = 4, 8
    costs = CostModel(
        forward=forward, backward_input=backward_input, backward_weight=backward_weight
    )
    timeline = _timeline(ZBH1(p, m), costs)
    total = forward + backward_input + backward_weight
    assert timeline.makespan == m * total + (p - 1) * (forward + backward_input - backward_weight)


@pytest.mark.parametrize(("p", "m"), [(2, 3), (2, 8), (4, 7), (4, 8), (5, 12), (8, 15)])
def test_zb_v_near_zero_bubble(p, m):
    """With F = I = W = 1 per chunk and m >= 2p - 1, the makespan is 6m + p - 1."""
    timeline = _timeline(ZBV(p, m, num_chunks=2))
    assert timeline.makespan == 6 * m + p - 1
    assert max(timeline.idle) == p - 1


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 12)])
def test_zb_v_memory_is_1f1bs(p, m):
    """ZB-V holds at most 2p chunk activations per stage: 1F1B's stage 0 (p microbatches x 2)."""
    timeline = _timeline(ZBV(p, m, num_chunks=2))
    assert timeline.peak_activations == (2 * p,) * p


def test_zb_v_idle_is_a_sixth_of_1f1b():
    """On the same model (1F1B stage = two ZB-V chunks), ZB-V idles a sixth of 1F1B's time."""
    p, m = 4, 8
    zb = _timeline(ZBV(p, m, num_chunks=2))
    one_f_one_b = _timeline(
        schedcc.get_schedule("1f1b")(p, m), CostModel(forward=2.0, backward=4.0)
    )
    assert [6 * idle for idle in zb.idle] == list(one_f_one_b.idle)


def test_zb_v_places_segments_in_a_v():
    """Segment k < p sits on stage k as chunk 0, segment k >= p on stage 2p - 1 - k as chunk 1."""
    schedule = ZBV(4, 8, num_chunks=2)
    assert schedule.segment_table() == [[0, 7], [1, 6], [2, 5], [3, 4]]


@pytest.mark.parametrize("chunks", [1, 3])
def test_zb_v_needs_two_chunks(chunks):
    """ZB-V refuses any num_chunks but 2 with a ScheduleConfigError naming the rule."""
    with pytest.raises(ScheduleConfigError, match="exactly two chunks"):
        ZBV(4, 8, num_chunks=chunks)


def test_zb_h1_needs_one_chunk():
    """ZB-H1 refuses virtual stages with a ScheduleConfigError naming its chunks and the fix."""
    with pytest.raises(ScheduleConfigError, match=r"chunks = \(1,\).*pass num_chunks=1"):
        ZBH1(4, 8, num_chunks=2)


def test_docstring_drawings_are_the_orders():
    """The p = 4, m = 8 orders drawn in the module docstrings are what the schedules yield."""
    from schedcc.schedules import zb_h1, zb_v

    for module, schedule in [(zb_h1, ZBH1(4, 8)), (zb_v, ZBV(4, 8, num_chunks=2))]:
        drawn = " ".join(module.__doc__.split("stage 0:", 1)[1].split()).split('"')[0]
        for s in range(4):
            line = " ".join(str(op) for op in schedule.order(s))
            assert line in drawn, (module.__name__, s)


@pytest.mark.parametrize(
    ("schedule", "dp", "zero"),
    [
        (ZBH1(3, 4), 1, 0),
        (ZBH1(2, 3, num_batches=2), 1, 0),
        (ZBV(2, 4), 1, 0),
        (ZBV(3, 2), 1, 0),
        (ZBV(2, 4), 2, 1),
    ],
    ids=lambda value: repr(value),
)
def test_trains_like_non_pipelined(schedule, dp, zero):
    """On the local backend in float64 (with data parallelism and ZeRO-1 too), both equal
    non-pipelined training to 1e-10."""
    pytest.importorskip("torch")
    from _models import batches, make_segments, mse, sgd

    from schedcc.backends.reference import assert_matches_reference

    program = schedcc.compile(schedule, data_parallel=dp, zero=zero)
    data = batches(2, 2 * dp * schedule.num_microbatches)
    segments = make_segments(schedule.num_segments)
    assert assert_matches_reference(program, segments, mse, sgd, data) < 1e-10
