"""v-half and v-min (Qi et al. 2024): they validate over the shapes they accept, train exactly,
and hold a half and a third of zb-v's activations, as their docstrings say."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import schedcc

NAMES = ("v-half", "v-min")
#: The most chunk activations a stage holds, by schedule, for p stages (module docstring).
BOUND = {"v-half": lambda p: 2 * (p // 2) + 2, "v-min": lambda p: 2 * ((p + 1) // 3) + 2}


def _peak(name, p, m):
    program = schedcc.compile(schedcc.get_schedule(name)(p, m))
    return max(schedcc.simulate(program).peak_activations)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("shape", "dp", "zero"), [((2, 3), 1, 0), ((3, 7), 2, 1), ((4, 8), 1, 0)])
def test_trains_like_non_pipelined(name, shape, dp, zero):
    """On the local backend in float64, two batches per program equal non-pipelined training."""
    pytest.importorskip("torch")
    from _models import batches, make_segments, mse, sgd

    from schedcc.backends.reference import assert_matches_reference

    schedule = schedcc.get_schedule(name)(*shape, num_batches=2)
    program = schedcc.compile(schedule, data_parallel=dp, zero=zero)
    data = batches(4, dp * schedule.num_microbatches)
    segments = make_segments(schedule.num_segments)
    assert assert_matches_reference(program, segments, mse, sgd, data) < 1e-10


@given(p=st.integers(1, 10), m=st.integers(1, 32))
def test_memory_bounds(p, m):
    """No stage holds more than 2*floor(p/2) + 2 (v-half) or 2*floor((p+1)/3) + 2 (v-min) chunk
    activations, reached once the pipeline is full; zb-v holds 2p."""
    for name, bound in BOUND.items():
        assert _peak(name, p, m) <= bound(p)
        if m >= 3 * p + 1:
            assert _peak(name, p, m) == bound(p)


#: Makespan and peak chunk activations (F = I = W = 1 per chunk) of the orders the paper's
#: reference code (sail-sg/zero-bubble-pipeline-parallelism, zbv_greedy.py) builds at p, m.
REFERENCE = {
    "v-half": {(4, 8): (53, 6), (4, 16): (101, 6), (8, 16): (113, 10), (6, 12): (83, 8)},
    "v-min": {(4, 8): (59, 4), (4, 16): (107, 4), (8, 16): (123, 8), (6, 12): (89, 6)},
}


@pytest.mark.parametrize(
    ("name", "p", "m"), [(name, p, m) for name in NAMES for p, m in REFERENCE[name]]
)
def test_makespan_and_peak_are_the_reference_codes(name, p, m):
    """With the reference code's greedy start-up and cool-down, each takes as long as the
    reference's orders and holds as many chunk activations, within its bound."""
    timeline = schedcc.simulate(schedcc.compile(schedcc.get_schedule(name)(p, m)))
    assert (timeline.makespan, max(timeline.peak_activations)) == REFERENCE[name][p, m]
    assert max(timeline.peak_activations) <= BOUND[name](p)


@pytest.mark.parametrize("p", [4, 6, 8])
def test_less_memory_than_zb_v_for_some_bubble(p):
    """Against zb-v at m = 2p: v-min holds at most v-half's activations, v-half fewer than zb-v's,
    and both take longer (the bubble they trade for memory)."""
    m = 2 * p
    peaks = {name: _peak(name, p, m) for name in ("v-min", "v-half", "zb-v")}
    assert peaks["v-min"] <= peaks["v-half"] < peaks["zb-v"] == 2 * p
    spans = {
        name: schedcc.simulate(schedcc.compile(schedcc.get_schedule(name)(p, m))).makespan
        for name in ("v-min", "v-half", "zb-v")
    }
    assert spans["zb-v"] < min(spans["v-half"], spans["v-min"])


@pytest.mark.parametrize("name", NAMES)
def test_docstring_orders_are_the_schedules(name):
    """The drawings in the module docstring are `schedcc show`'s at 100 columns and the per-stage
    orders there are what the schedules yield, at p = 4, m = 8."""
    from schedcc.schedules import v_shapes

    part = v_shapes.__doc__.split("V-Half:\n", 1)[1].split("and V-Min:", 1)
    text = part[0 if name == "v-half" else 1]
    drawn = " ".join(text.split())
    schedule = schedcc.get_schedule(name)(4, 8)
    timeline = schedcc.simulate(schedcc.compile(schedule))
    for line in timeline.to_ascii(width=86, color=False).splitlines()[1:]:
        assert f"    {line}\n" in text
    for stage in range(4):
        assert f"stage {stage}: " + " ".join(map(str, schedule.order(stage))) in drawn


def test_one_chunk_is_refused():
    """Both need the V's two chunks; a config error names the fix."""
    with pytest.raises(schedcc.ScheduleConfigError, match="-v 2"):
        schedcc.get_schedule("v-half")(4, 8, 1)
