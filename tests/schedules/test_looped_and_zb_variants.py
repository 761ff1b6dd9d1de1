"""looped-bfs, zb-h2 and interleaved-zb: they validate over the shapes they accept, train exactly,
keep their docstrings' numbers, and are as good as torch's own orders for the same schedules."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import schedcc
from schedcc import ScheduleConfigError
from schedcc.simulate import CostModel

UNIT = CostModel(forward=1.0, backward=2.0, backward_input=1.0, backward_weight=1.0)
NAMES = ("looped-bfs", "zb-h2", "interleaved-zb")
#: schedcc's built-in and torch's class for the same schedule, compared at p in {2, 4}.
TORCH_PEERS = [
    ("looped-bfs", "ScheduleLoopedBFS"),
    ("interleaved-zb", "ScheduleInterleavedZeroBubble"),
    ("zb-v", "ScheduleZBVZeroBubble"),
    ("dualpipe-v", "ScheduleDualPipeV"),
]


def _get(name):
    return schedcc.get_schedule(name)


def _timeline(schedule, costs=UNIT):
    return schedcc.simulate(schedcc.compile(schedule), costs)


def _held(schedule, stage: int, freed_by: str) -> int:
    """The most microbatch-chunks stage `stage` holds between a forward and its `freed_by`."""
    held = peak = 0
    for op in schedule.order(stage):
        held += (op.code == "F") - (op.code == freed_by)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize(
    ("name", "shape", "dp", "zero"),
    [
        ("looped-bfs", (3, 4, 2, 2), 2, 1),
        ("zb-h2", (3, 5, 1, 2), 1, 0),
        ("zb-h2", (4, 7, 1, 1), 2, 1),
        ("interleaved-zb", (2, 4, 2, 2), 1, 0),
        ("interleaved-zb", (3, 5, 3, 1), 2, 1),
    ],
)
def test_trains_like_non_pipelined(name, shape, dp, zero):
    """The full pipeline shapes (warm-up, steady state, tail) train exactly too."""
    pytest.importorskip("torch")
    from _models import batches, make_segments, mse, sgd

    from schedcc.backends.reference import assert_matches_reference

    schedule = _get(name)(*shape)
    program = schedcc.compile(schedule, data_parallel=dp, zero=zero)
    data = batches(2, dp * schedule.num_microbatches)
    segments = make_segments(schedule.num_segments)
    assert assert_matches_reference(program, segments, mse, sgd, data) < 1e-10


# -- looped-bfs ---------------------------------------------------------------------------------


@given(p=st.integers(1, 6), m=st.integers(1, 12), v=st.integers(1, 4), batches=st.integers(1, 2))
def test_looped_bfs_is_gpipe_over_looped_chunks(p, m, v, batches):
    """looped-bfs yields gpipe's order with v chunks: chunk after chunk, backwards reversed."""
    bfs, gpipe = _get("looped-bfs")(p, m, v, batches), _get("gpipe")(p, m, v, batches)
    for stage in range(p):
        assert list(bfs.order(stage)) == list(gpipe.order(stage))


@pytest.mark.parametrize(("p", "m", "v"), [(2, 2, 2), (2, 8, 3), (4, 4, 2), (4, 8, 2), (8, 8, 4)])
def test_looped_bfs_bubble_and_memory(p, m, v):
    """For m >= p: makespan 3(vm + p - 1) (F = 1, B = 2), every stage holds all m * v."""
    timeline = _timeline(_get("looped-bfs")(p, m, v))
    assert timeline.makespan == 3 * (v * m + p - 1)
    assert timeline.peak_activations == (m * v,) * p


def test_looped_bfs_defaults_to_two_chunks():
    """LoopedBFS(p, m) loops twice round the stages, as torch's does with two local stages."""
    assert _get("looped-bfs")(4, 8).num_chunks == 2


# -- zb-h2 --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), [(2, 3), (2, 8), (3, 5), (4, 7), (4, 8), (5, 12), (8, 15)])
@pytest.mark.parametrize("batches", [1, 2, 3])
def test_zb_h2_has_no_bubble_between_batches(p, m, batches):
    """With F = I = W = 1 and m >= 2p - 1, B batches take 3mB + p - 1: each stage works without a
    gap from its first forward to its last W, so the start-up is paid once per program."""
    timeline = _timeline(_get("zb-h2")(p, m, num_batches=batches))
    assert timeline.makespan == 3 * m * batches + p - 1
    assert timeline.idle == (p - 1.0,) * p


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 16)])
def test_zb_h2_beats_zb_h1_across_batches(p, m):
    """At F = I = W, one batch takes ZB-H1's 3m + p - 1; three take 2(p - 1) units less."""
    h1, h2 = _get("zb-h1"), _get("zb-h2")
    assert _timeline(h2(p, m)).makespan == _timeline(h1(p, m)).makespan == 3 * m + p - 1
    three = [_timeline(cls(p, m, num_batches=3)).makespan for cls in (h1, h2)]
    assert three[0] - three[1] == 2 * (p - 1)


@pytest.mark.parametrize(
    ("forward", "backward_input", "backward_weight"),
    [(1.0, 1.0, 0.5), (1.0, 2.0, 1.0), (2.0, 3.0, 1.5), (1.0, 1.5, 1.0), (1.5, 3.0, 0.5)],
)
def test_zb_h2_formula_with_other_costs(forward, backward_input, backward_weight):
    """For W <= F <= I, one batch takes m(F+I+W) + (p-1) max(F, F+I-2W) and each further batch
    adds m(F+I+W) + (p-1)(F+I-2W), the paper's ZB-H2 bubble."""
    p, m = 4, 9
    costs = CostModel(
        forward=forward, backward_input=backward_input, backward_weight=backward_weight
    )
    total, bubble = forward + backward_input + backward_weight, forward + backward_input
    bubble -= 2 * backward_weight
    one = _timeline(_get("zb-h2")(p, m), costs).makespan
    two = _timeline(_get("zb-h2")(p, m, num_batches=2), costs).makespan
    assert one == pytest.approx(m * total + (p - 1) * max(forward, bubble))
    assert two - one == pytest.approx(m * total + (p - 1) * bubble)


@given(p=st.integers(1, 8), m=st.integers(1, 24))
def test_zb_h2_memory_is_about_twice_zb_h1s(p, m):
    """Stage s holds min(2(p - s) - 1, m) microbatches from F to I, and every stage
    min(2p - 1, m) from F to W; ZB-H1 holds min(p - s, m) and min(p, m)."""
    h2, h1 = _get("zb-h2")(p, m), _get("zb-h1")(p, m)
    for s in range(p):
        assert _held(h2, s, "I") == min(2 * (p - s) - 1, m)
        assert _held(h2, s, "W") == min(2 * p - 1, m)
        assert (_held(h1, s, "I"), _held(h1, s, "W")) == (min(p - s, m), min(p, m))


def test_zb_h2_needs_one_chunk():
    """ZB-H2 refuses virtual stages with a ScheduleConfigError naming its chunks and the fix."""
    with pytest.raises(ScheduleConfigError, match=r"chunks = \(1,\).*pass num_chunks=1"):
        _get("zb-h2")(4, 8, 2)


# -- interleaved-zb -----------------------------------------------------------------------------


@given(shape=st.tuples(st.integers(1, 8), st.integers(1, 3), st.integers(1, 4)))
def test_interleaved_zb_bubble_and_memory(shape):
    """For m a multiple of p at F = I = W = 1: makespan 3vm + p - 1; stage s holds at most
    min(vp - s, vm) chunk activations from F to I and min(vp, vm) from F to W."""
    p, groups, v = shape
    m = p * groups
    schedule = _get("interleaved-zb")(p, m, v)
    assert _timeline(schedule).makespan == 3 * v * m + p - 1
    for s in range(p):
        assert _held(schedule, s, "I") == min(v * p - s, v * m)
        assert _held(schedule, s, "W") == min(v * p, v * m)


@given(p=st.integers(1, 6), m=st.integers(1, 12), batches=st.integers(1, 2))
def test_interleaved_zb_with_one_chunk_is_zb_h1(p, m, batches):
    """With v = 1 the interleaved zero-bubble order is exactly ZB-H1's."""
    ours, h1 = _get("interleaved-zb")(p, m, 1, batches), _get("zb-h1")(p, m, 1, batches)
    for stage in range(p):
        assert list(ours.order(stage)) == list(h1.order(stage))


@pytest.mark.parametrize(
    ("p", "m", "v"),
    [(2, 1, 2), (2, 2, 2), (2, 8, 3), (3, 2, 2), (4, 3, 2), (4, 4, 2), (4, 8, 2), (4, 10, 3),
     (4, 12, 4), (8, 16, 2), (8, 24, 3)],
)  # fmt: skip
def test_interleaved_zb_equals_torch_where_torch_accepts(p, m, v):
    """Where torch accepts the shape, each stage's order is ScheduleInterleavedZeroBubble's."""
    pytest.importorskip("torch")
    from schedcc.interop.torch import torch_schedule

    theirs = torch_schedule("ScheduleInterleavedZeroBubble", p, m, num_chunks=v)
    ours = _get("interleaved-zb")(p, m, v)
    for stage in range(p):
        assert list(ours.order(stage)) == list(theirs.order(stage))


# -- against torch, and the drawings ------------------------------------------------------------


@pytest.mark.parametrize(("name", "torch_name"), TORCH_PEERS)
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [8, 16])
def test_as_good_as_torchs_order(name, torch_name, p, m):
    """schedcc's order takes no longer (F = 1, B = 2, I = W = 1, same simulator) and holds no
    more activations on any stage than torch's own order for the same schedule."""
    pytest.importorskip("torch")
    from schedcc.interop.torch import torch_schedule

    ours = _timeline(_get(name)(p, m, num_chunks=2))
    theirs = _timeline(torch_schedule(torch_name, p, m, num_chunks=2))
    assert ours.makespan <= theirs.makespan
    assert all(a <= b for a, b in zip(ours.peak_activations, theirs.peak_activations))


@pytest.mark.parametrize(
    ("module_name", "name", "shape"),
    [("looped_bfs", "looped-bfs", (4, 4)), ("interleaved_zb", "interleaved-zb", (4, 8))],
)
def test_docstring_orders_are_the_schedules(module_name, name, shape):
    """The per-stage compute orders printed in the module docstrings are what the schedules
    yield."""
    import importlib

    module = importlib.import_module(f"schedcc.schedules.{module_name}")
    drawn = " ".join(module.__doc__.split("stage 0:", 1)[1].split())
    schedule = _get(name)(*shape)
    for stage in range(schedule.num_stages):
        assert " ".join(str(op) for op in schedule.order(stage)) in drawn, stage


def test_zb_h2_docstring_drawing_is_schedcc_show():
    """The ZB-H2 drawing in its docstring is `schedcc show`'s ascii timeline, line for line."""
    from schedcc.schedules import zb_h2

    timeline = _timeline(_get("zb-h2")(4, 8))
    for line in timeline.to_ascii().splitlines()[1:]:
        assert f"    {line}\n" in zb_h2.__doc__
