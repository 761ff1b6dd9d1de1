"""`schedcc.search`: found orders validate, train exactly, fit their memory limit, match or beat
the built-ins, stay above their lower bound, and round-trip through the file they print."""

from __future__ import annotations

import functools
from itertools import pairwise

import attrs
import pytest
import torch
from hypothesis import event, example, given
from hypothesis import strategies as st
from strategies import stage_costs
from torch import nn

import schedcc
from schedcc import CostModel, MemoryModel, ScheduleConfigError
from schedcc.backends.local import Engine
from schedcc.backends.reference import assert_matches_reference
from schedcc.backends.runtime.memory import measure_memory
from schedcc.cli import main
from schedcc.ir import Recompute, parse
from schedcc.registry import get_schedule, registered_classes
from schedcc.search import FoundOrder, _Family, lower_bound, search
from tests._models import batches, make_segments, mse, schedule_segments, sgd


def _heavy_last(p: int, comm: float) -> CostModel:
    """Costs with the last stage 1.5x the others (the LM head and the loss) and a comm cost."""
    last = CostModel(forward=1.5, backward=3.0, backward_input=1.5, backward_weight=1.5, comm=comm)
    return CostModel(comm=comm, per_stage={p - 1: last})


@functools.cache
def _found(p, m, chunks, split, limit=None, comm=None, offload=False):
    """A search at a shape (cached: several tests read one result); a fixed budget of
    evaluations so it finds the same order on every machine."""
    costs = CostModel() if comm is None else _heavy_last(p, comm)
    return search(
        p,
        m,
        num_chunks=chunks,
        split_backward=split,
        costs=costs,
        memory_limit=limit,
        recompute=limit is not None,
        offload=offload,
        time_limit=120,
        max_evaluations=150,
    )


def _best_builtin(p, m, costs, limit, split=(False, True)):
    """The fastest built-in time (any v, with or without recomputation) within `limit`."""
    ranked = schedcc.tune(
        num_stages=p,
        num_microbatches=m,
        num_chunks=(1, 2),
        costs=costs,
        memory_limit=limit,
        recompute=(False, True),
    ).ranked
    return min(c.makespan for c in ranked)


SEARCHES = [
    (3, 4, 1, False, None, None),
    (4, 8, 1, True, None, None),
    (3, 6, 2, True, None, None),
    (4, 8, (1, 2), (False, True), 2, 0.05),
    (4, 8, 1, False, 2, None),
    (4, 8, (1, 2), (False, True), 1, 0.05, True),
]


@pytest.mark.parametrize("args", SEARCHES, ids=str)
def test_found_orders_train_exactly(args):
    """Every found order compiles (the validator proves it) and trains a float64 model exactly
    as non-pipelined training does, on the local engine, over two batches."""
    result = _found(*args)
    schedule = type(result.schedule)(*result.schedule.shape, num_batches=2)
    program = schedcc.compile(schedule)
    rows = schedule.num_microbatches * 2
    difference = assert_matches_reference(
        program, schedule_segments(schedule), mse, sgd, batches(2, rows), atol=1e-10
    )
    assert difference <= 1e-10


def _measured(p: int, m: int, size: int = 2, width: int = 16):
    """`(segments, x, y, memory)`: p Linear+Tanh segments, m microbatches of `size` rows, and
    the bytes the local engine measures for one microbatch of them."""
    torch.manual_seed(0)
    segments = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(p)]
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(m * size, width, generator=gen), torch.randn(m * size, width, generator=gen)
    measured = measure_memory(segments, x[:size], y[:size], nn.functional.mse_loss)
    return segments, x, y, MemoryModel(activations=measured.activations, inputs=measured.inputs)


@pytest.mark.parametrize(("v", "placement"), [(3, "v"), (4, "wave")])
def test_wave_orders_are_searched_and_train_exactly(v, placement):
    """At more than two chunks the V placement is a wave (each odd chunk runs back up the
    stages: Hanayo's at v = 4): the search builds orders of it, which validate from their
    written file and train a float64 model exactly."""
    result = search(3, 4, num_chunks=v, placement=placement, max_evaluations=40)
    cls = type(result.schedule)
    assert cls.vshape
    assert cls.shape == (3, 4, v)
    stages = [cls(3, 4, v).placement(k)[0] for k in range(3 * v)]
    assert stages == [0, 1, 2, 2, 1, 0, 0, 1, 2, 2, 1, 0][: 3 * v]
    namespace = {}
    exec(result.to_python(), namespace)  # the file it writes
    assert f"v={v} (wave placement)" in namespace["__doc__"]
    replayed = schedcc.compile(namespace["Found"](3, 4, v))
    assert schedcc.simulate(replayed, result.timeline.costs).makespan == result.makespan
    schedule = namespace["Found"](3, 4, v, num_batches=2)
    program = schedcc.compile(schedule)
    difference = assert_matches_reference(
        program, schedule_segments(schedule), mse, sgd, batches(2, 8), atol=1e-10
    )
    assert difference <= 1e-10


def test_a_search_of_whole_backwards_starts_from_the_builtins_made_whole():
    """Searching F/B orders only (`split_backward=False`), the built-ins whose orders split
    the backward (ZB's, DualPipe's) are started from with each I and W run as one B, in their
    own layouts. At p = 4, m = 8, 1:1.5:0.8, comm 1F, a 1.3x first stage, 1F1B's activations:
    an order of DualPipe's two replicas, faster than the looped placements' best; it splits no
    backward, validates from its written file and trains a float64 model exactly."""
    heavy = CostModel(forward=1.3, backward=1.95, backward_input=0.91, backward_weight=1.04,
                      comm=1.0)  # fmt: skip
    costs = CostModel(forward=1.0, backward=1.5, backward_input=0.7, backward_weight=0.8,
                      comm=1.0, per_stage={0: heavy})  # fmt: skip
    common = {"costs": costs, "memory_limit": 4, "recompute": True, "split_backward": False,
              "max_evaluations": 60, "eager": True}  # fmt: skip
    result = search(4, 8, **common)
    looped = search(4, 8, num_chunks=(1, 2), placement="looped", **common)
    cls = type(result.schedule)
    assert cls.num_replicas == 2
    assert not any(text.startswith(("I", "W")) for row in cls.orders for text in row.split())
    assert result.bound <= result.makespan < looped.makespan
    namespace = {}
    exec(result.to_python(), namespace)
    schedule = namespace["Found"](4, 8, 2, num_batches=2)
    program = schedcc.compile(schedule)
    difference = assert_matches_reference(
        program, schedule_segments(schedule), mse, sgd, batches(2, 16), atol=1e-10
    )
    assert difference <= 1e-10


def test_dualpipe_with_whole_backwards_starts_a_search_of_both_forms():
    """Searching both backward forms, DualPipe's order is also started from with its I and W
    run as one B where it fits neither as it is nor recomputing every forward: under a tight
    limit a whole backward frees its activation at once. At p = 4,
    m = 8, 1:2:1, comm 1F, a 1.5x last stage, 0.3x 1F1B's activations: an order of its two
    replicas with whole backwards, 42.0, where the looped placements' best, 47.5, meets their
    bound (so no looped order is faster)."""
    last = CostModel(forward=1.5, backward=3.0, backward_input=1.5, backward_weight=1.5,
                     comm=1.0)  # fmt: skip
    costs = CostModel(comm=1.0, per_stage={3: last})
    common = {"costs": costs, "memory_limit": 1.2, "recompute": True, "max_evaluations": 40,
              "eager": True}  # fmt: skip
    result = search(4, 8, **common)
    looped = search(4, 8, num_chunks=(1, 2), placement="looped", **common)
    cls = type(result.schedule)
    assert cls.num_replicas == 2
    assert not any(text.startswith("W") for row in cls.orders for text in row.split())
    assert result.makespan == pytest.approx(42.0)
    assert looped.makespan == pytest.approx(looped.bound) == pytest.approx(47.5)
    assert result.bound <= result.makespan


@pytest.mark.parametrize("split", [True, False])
def test_each_backward_form_starts_from_the_builtins(split):
    """Given one evaluation, a search of F/I/W orders alone returns a built-in's own order,
    its backwards split; one of F/B orders alone, a built-in whose backwards are whole."""
    result = search(4, 8, split_backward=split, max_evaluations=1)
    assert result.source in registered_classes()
    orders = type(result.schedule).orders
    assert any(text.startswith("W") for row in orders for text in row.split()) is split


def test_found_order_holds_no_more_measured_bytes_than_the_limit():
    """Under a byte limit of half 1F1B's measured activation bytes, the local engine measures
    at most the limit on every stage while training with the found order."""
    p, m = 4, 8
    segments, x, y, memory = _measured(p, m)
    one_f_one_b = schedcc.simulate(
        schedcc.compile(get_schedule("1f1b")(p, m)), CostModel(memory=memory)
    )
    limit = max(one_f_one_b.peak_activation_bytes) / 2
    result = search(
        p, m, num_chunks=1, memory=memory, memory_limit=limit, recompute=True, max_evaluations=80
    )
    engine = Engine(result.program, segments, nn.functional.mse_loss, sgd)
    list(engine.train([(x, y)]))
    assert max(engine.peak_activation_bytes) <= limit
    assert max(result.peak_bytes) <= limit


@given(
    p=st.integers(2, 3),
    m=st.integers(2, 6),
    v=st.sampled_from([1, 2]),
    widths=st.lists(st.integers(2, 40), min_size=7, max_size=7),
    share=st.sampled_from([0.5, 0.75, 1.0]),
    offload=st.booleans(),
)
# DualPipe's replicas, of another cut, made whole after the evaluations are spent
@example(p=2, m=4, v=2, widths=[2, 2, 4, 2, 2, 2, 2], share=0.5, offload=False)
def test_searches_in_measured_bytes_fit_as_the_engine_measures(p, m, v, widths, share, offload):
    """Random unequal segments cut in p·v, their bytes measured (`measure_memory`: each
    segment's own, [Note: a measured cut]), a limit of a share of 1F1B's (interleaved at v = 2)
    peak on each stage, with room for one microbatch: the search finds an order of that cut (at
    v = 1 or DualPipe's replicas of it, or at v = 2), the local engine training it measures the
    activation peak the search simulated, at most the limit, and trains exactly; asked only for
    orders of another cut, it refuses."""
    size, n = 2, p * v
    torch.manual_seed(0)
    segments = [
        nn.Sequential(nn.Linear(a, b), nn.Tanh()).double()
        for a, b in pairwise(widths[: n + 1])
    ]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m * size, widths[0], generator=gen, dtype=torch.float64)
    y = torch.randn(m * size, widths[n], generator=gen, dtype=torch.float64)
    measured = measure_memory(segments, x[:size], y[:size], nn.functional.mse_loss)
    assert measured.cut == n
    memory = attrs.evolve(measured, parameters=0)  # a limit on activations, as the engine's
    reference = schedcc.compile(get_schedule("1f1b" if v == 1 else "interleaved-1f1b")(p, m, v))
    peaks = schedcc.simulate(reference, CostModel(memory=memory)).peak_activation_bytes
    # at least the largest activation beside every segment's input: room for one microbatch
    least = max(memory.activations) + sum(memory.inputs)
    limit = [max(share * peak, least) for peak in peaks]
    try:
        result = search(
            p, m, num_chunks=(1, 2), memory=memory, memory_limit=limit, recompute=True,
            offload=offload, max_evaluations=15, method="heuristic",
        )  # fmt: skip
    except ScheduleConfigError as exc:  # nothing fits a limit below one microbatch's needs
        if "no order" not in str(exc):
            raise
        event("no order fits")
        return
    replicas = type(result.schedule).num_replicas  # DualPipe's: two of the cut in p
    assert result.schedule.num_segments == n * replicas
    engine = Engine(result.program, segments * replicas, nn.functional.mse_loss, sgd)
    list(engine.train([(x, y)]))
    assert tuple(engine.peak_activation_bytes) == result.timeline.peak_activation_bytes
    assert all(b <= lim * (1 + 1e-9) for b, lim in zip(engine.peak_activation_bytes, limit))
    difference = assert_matches_reference(
        result.program, segments * replicas, nn.functional.mse_loss, sgd, [(x, y)], atol=1e-10
    )
    assert difference <= 1e-10
    with pytest.raises(ScheduleConfigError, match=rf"cut in {n} segments.*search v = {v}"):
        search(p, m, num_chunks=3 - v, memory=memory, memory_limit=limit, max_evaluations=2)


def test_offloading_fits_one_microbatch_a_stage_faster_than_recomputing():
    """At one microbatch's activations a stage (a heavy last stage, comm 0.05F), the search
    with `offload=True` places its own offloads and reloads: the order fits, carries its copies
    in the written orders, replays to the same makespan and is faster than the best order
    without offloading; its bound leaves the memory terms out."""
    p, m = 4, 8
    recomputing = _found(p, m, (1, 2), (False, True), 1, 0.05)
    offloading = _found(p, m, (1, 2), (False, True), 1, 0.05, True)
    orders = type(offloading.schedule).orders
    assert any(text[0] == "O" for row in orders for text in row.split())
    assert any(text[0] == "L" for row in orders for text in row.split())
    assert "offload" in offloading.source
    assert max(offloading.peak_activations) <= 1
    assert offloading.makespan < recomputing.makespan
    cls = type(offloading.schedule)
    replayed = schedcc.simulate(schedcc.compile(cls(*cls.shape)), offloading.timeline.costs)
    assert replayed.makespan == offloading.makespan
    assert offloading.bound <= offloading.makespan + 1e-9
    v = offloading.schedule.num_chunks
    unlimited = lower_bound(p, m, _heavy_last(p, 0.05), _Family(v, False, False))
    assert offloading.bound <= unlimited + 1e-9


def test_offloaded_order_holds_no_more_measured_device_bytes_than_the_limit():
    """With copies priced (half a forward each way), no recomputation and a byte limit of half
    1F1B's measured activation bytes, the order `search(offload=True)` finds offloads, trains
    on the local engine within the limit on the device, and like non-pipelined training."""
    p, m = 4, 8
    segments, x, y, memory = _measured(p, m)
    costs = CostModel(offload=0.5, reload=0.5, memory=memory)
    one_f_one_b = schedcc.simulate(schedcc.compile(get_schedule("1f1b")(p, m)), costs)
    limit = max(one_f_one_b.peak_activation_bytes) / 2
    result = search(
        p, m, num_chunks=1, costs=costs, memory_limit=limit, offload=True, max_evaluations=80
    )
    assert any(type(op).__name__ == "Offload" for row in result.program.stages for op in row)
    engine = Engine(result.program, segments, nn.functional.mse_loss, sgd)
    list(engine.train([(x, y)]))
    assert max(engine.peak_activation_bytes) <= limit
    assert max(result.peak_bytes) <= limit
    difference = assert_matches_reference(
        result.program, make_segments(p), mse, sgd, batches(1, m), atol=1e-10
    )
    assert difference <= 1e-10


def test_balanced_search_matches_1f1b_and_zb_h1():
    """Balanced costs, p=4, m=8: no slower than 1F1B with F/B, none slower than ZB-H1 with
    F/I/W."""
    simulate = schedcc.simulate
    one_f_one_b = simulate(schedcc.compile(get_schedule("1f1b")(4, 8))).makespan
    zb_h1 = simulate(schedcc.compile(get_schedule("zb-h1")(4, 8))).makespan
    assert _found(4, 8, 1, False).makespan <= one_f_one_b
    assert _found(4, 8, 1, True).makespan <= zb_h1


@pytest.mark.parametrize("comm", [0.05, 1.0])
def test_heavy_last_stage_is_no_slower_than_any_builtin_in_1f1b_memory(comm):
    """A 1.5x last stage and comm 0.05F or 1F, limited to 1F1B's activations (p microbatches):
    the found order is no slower than every built-in that fits, recomputing or not."""
    p, m = 4, 8
    found = _found(p, m, (1, 2), (False, True), p, comm)
    assert found.makespan <= _best_builtin(p, m, _heavy_last(p, comm), p) + 1e-9
    assert max(found.peak_activations) <= p


def test_half_the_activations_beats_1f1b_with_full_recomputation():
    """At half 1F1B's activations the found order fits and is faster than 1F1B recomputing
    every forward (selective recomputation placed in the bubbles)."""
    p, m = 4, 8
    found = _found(p, m, 1, False, p // 2)
    recomputing = schedcc.simulate(
        schedcc.compile(get_schedule("1f1b")(p, m), recompute=True)
    ).makespan
    assert max(found.peak_activations) <= p // 2
    assert found.makespan < recomputing


def test_a_builtin_recomputing_every_forward_keeps_only_the_recomputations_it_needs():
    """p = 4, m = 8, 1:2:1, a 1.3x first stage, 0.6x 1F1B's activations: DualPipe-V fits only
    recomputing (39.97 recomputing every forward); kept where the limit needs them, 26 of its
    64 recomputations, it runs 32.825, in the first evaluations of the search, which list
    scheduling's best orders (33.8 and above) do not reach."""
    heavy = CostModel(forward=1.3, backward=2.6, backward_input=1.3, backward_weight=1.3)
    costs = CostModel(per_stage={0: heavy})
    found = search(4, 8, costs=costs, memory_limit=2.4, recompute=True, max_evaluations=25,
                   eager=True)  # fmt: skip
    assert found.source.startswith("dualpipe-v with selective recompute")
    assert found.makespan == pytest.approx(32.825)
    assert max(found.peak_activations) <= 2.4 + 1e-9
    redone = sum(text.startswith("R") for row in found.schedule.orders for text in row)
    assert redone == 26


def test_an_offloading_builtin_is_kept_with_its_offloads():
    """At 2 microbatches a stage without recomputation only 1F1B-offload fits among the 1F1B
    orders: the found order keeps its offloads and reloads, is no slower, holds no more than
    the limit, and its bound (its layout bounded without the limit) is no higher."""
    offload = schedcc.simulate(schedcc.compile(get_schedule("1f1b-offload")(4, 8))).makespan
    found = search(4, 8, num_chunks=1, memory_limit=2, max_evaluations=30)
    assert any(text[0] == "O" for row in found.schedule.orders for text in row)
    assert found.makespan <= offload + 1e-9
    assert max(found.peak_activations) <= 2
    assert found.bound <= found.makespan + 1e-9


def test_the_written_file_round_trips(tmp_path, capsys):
    """`to_python` writes a file whose class `verify` and `show` take, that replays the same
    program, and from which a second search of the same budget finds nothing faster (the
    first ends at its local optimum: with 150 evaluations it stops at DualPipe-V's 18.25,
    where a move on every stage reaches 18.0)."""
    result = search(3, 6, num_chunks=2, split_backward=True, time_limit=120,
                    max_evaluations=400)  # fmt: skip
    path = tmp_path / "my_order.py"
    path.write_text(result.to_python())
    cls = get_schedule(f"{path}:Found")
    assert issubclass(cls, FoundOrder)
    replayed = schedcc.compile(cls(3, 6, 2))
    assert replayed.to_text() == result.program.to_text()
    assert main(["verify", "--schedule", f"{path}:Found", "-p", "3", "-m", "6", "-v", "2"]) == 0
    assert main(["show", "--schedule", f"{path}:Found", "-p", "3", "-m", "6", "-v", "2"]) == 0
    assert "F0" in capsys.readouterr().out
    again = search(
        3,
        6,
        num_chunks=2,
        split_backward=True,
        start=[cls],
        builtins=False,
        time_limit=120,
        max_evaluations=400,
    )
    assert again.makespan == result.makespan


def test_a_found_class_refuses_other_shapes():
    """The replayed order belongs to its shape; another is a `ScheduleConfigError` naming it."""
    cls = type(_found(3, 4, 1, False).schedule)
    with pytest.raises(ScheduleConfigError, match="p=3, m=4, v=1"):
        cls(4, 4, 1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_chunks": 5},
        {"placement": "zigzag"},
        {"time_limit": 0},
        {"memory_limit": -1},
        {"memory_limit": [1, 2]},
        {"costs": "F=1"},
        {"start": ["1f1b"]},
        {"placement": "v", "num_chunks": 1},
        {"data_parallel": 0},
        {"zero": 4},
        {"max_evaluations": 0},
        {"offload": "yes"},
        {"recompute": 1},
    ],
    ids=str,
)
def test_bad_arguments_are_config_errors(kwargs):
    """Each bad argument is a `ScheduleConfigError` that names it."""
    with pytest.raises(ScheduleConfigError, match="search"):
        search(4, 8, **kwargs)


def test_an_impossible_limit_says_so():
    """A limit below one microbatch of every stage: no order fits, and the error says how far
    the leanest one was."""
    with pytest.raises(ScheduleConfigError, match=r"no order .* fits the memory limit"):
        search(3, 4, num_chunks=1, memory_limit=0.2, recompute=False, max_evaluations=40)


@given(
    p=st.integers(1, 4),
    m=st.integers(1, 6),
    chunks=st.sampled_from([1, 2, (1, 2), 3, 4]),
    split=st.booleans(),
    last=st.floats(0.5, 2.0),
    comm=st.sampled_from([0.0, 0.1, 1.0]),
)
def test_random_searches_validate_and_stay_above_the_bound(p, m, chunks, split, last, comm):
    """Random small shapes and costs: the found order validates again from its class, its
    makespan is the simulator's, and it is never below the lower bound, which is no more than
    any searched kind's."""
    costs = CostModel(
        comm=comm,
        per_stage={p - 1: CostModel(forward=last, backward=2 * last, comm=comm)},
    )
    result = search(p, m, num_chunks=chunks, split_backward=split, costs=costs, max_evaluations=25)
    cls = type(result.schedule)
    program = schedcc.compile(cls(*cls.shape))
    assert schedcc.simulate(program, result.timeline.costs).makespan == result.makespan
    assert result.makespan >= result.bound - 1e-9
    chunks = (chunks,) if isinstance(chunks, int) else chunks
    searched = min(
        lower_bound(p, m, costs, _Family(v, vshape, split))
        for v in chunks
        for vshape in (False, True)
        if not vshape or (v >= 2 and p >= 2)
    )
    # the least over the searched kinds and the built-in layouts that fit (DualPipe's pairs)
    assert result.bound <= searched + 1e-9


@given(
    p=st.integers(2, 4),
    m=st.integers(2, 6),
    chunks=st.sampled_from([1, 2]),
    limit=st.sampled_from([1.0, 1.5, 2.0]),
    copy=st.sampled_from([0.0, 0.5, 2.0]),
    recompute=st.booleans(),
    # whole bytes at v = 1 and 2 (a `MemoryModel` holds whole bytes; a chunk holds half)
    sizes=st.none() | st.lists(st.integers(1, 50).map(lambda x: 2 * x), min_size=4, max_size=4),
    eager=st.booleans(),
)
def test_random_offloading_searches_fit_and_train_exactly(
    p, m, chunks, limit, copy, recompute, sizes, eager
):
    """Random small shapes, limits (in microbatches, or in bytes with random per-stage sizes)
    and copy costs with `offload=True`, timed in the rendezvous model or eagerly: the found
    order (with the copies the search placed) validates again from its class, replays to its
    makespan in that model, fits the limit, stays above its bound, and trains a float64 model on
    the local engine as non-pipelined training does."""
    costs = CostModel(offload=copy, reload=copy)
    limits = limit
    if sizes is not None:  # each stage's parameters, gradients and Adam state, and `limit`
        activations, parameters = sizes[:p], sizes[-p:]
        costs = attrs.evolve(costs, memory=MemoryModel(
            activations=activations, parameters=parameters, optimizer=[2 * x for x in parameters]
        ))  # fmt: skip
        limits = [4 * w + limit * a for w, a in zip(parameters, activations)]
    result = search(  # one microbatch at a time fits any limit of one or more
        p, m, num_chunks=chunks, costs=costs, memory_limit=limits, recompute=recompute,
        offload=True, max_evaluations=25, eager=eager,
    )  # fmt: skip
    cls = type(result.schedule)
    program = schedcc.compile(cls(*cls.shape))
    replayed = schedcc.simulate(program, result.timeline.costs, eager=eager)
    assert replayed.makespan == result.makespan
    if sizes is None:
        assert max(result.peak_activations) <= limit + 1e-9
    else:
        assert all(b <= lim * (1 + 1e-9) for b, lim in zip(result.peak_bytes, limits))
    assert result.makespan >= result.bound - 1e-9
    difference = assert_matches_reference(
        program, schedule_segments(program.schedule), mse, sgd, batches(1, m),
        atol=1e-10,
    )  # fmt: skip
    assert difference <= 1e-10


def test_list_scheduling_counts_each_segment_at_its_stages_size():
    """Per-stage sizes follow each segment to its stage in list scheduling as in the simulated
    candidates: the V puts chunk 1 of stage s on segment 2p - 1 - s, and each chunk holds half
    its stage's bytes; its budgets leave out the parameters each stage holds."""
    from schedcc.search import _ListScheduler, _Searcher

    memory = MemoryModel(activations=[10, 20, 30], inputs=[2, 4, 6], parameters=[100, 0, 0])
    costs = CostModel(memory=memory)
    family = _Family(2, True, False)
    scheduler = _ListScheduler(3, 6, family, costs, None, False)
    assert scheduler.act == [5, 10, 15, 15, 10, 5]
    assert scheduler.inp == [1, 2, 3, 3, 2, 1]
    searcher = _Searcher(3, 6, costs, (500.0,) * 3, False, False, 1, 0, 0.0, None, None)
    assert searcher._budgets(family) == [500 - 200, 500, 500]  # parameters and gradients


def test_list_scheduling_keeps_room_for_a_recomputation_it_owes():
    """A forward that would hold its activation where an earlier recomputed one must be rebuilt
    before its backward is recomputed too (`_Rule.owed`): every such rule of an F/I/W order at
    one microbatch a stage (a 1.5x last stage) finishes, where some without it get stuck; and
    the eager search meets its bound there, 41.5 (the last stage busy from its head to its
    last input gradient but for the one weight gradient it may hold, then three input
    gradients and stage 0's weight gradient)."""
    import random

    from schedcc.search import _ListScheduler, _rules

    costs = CostModel(per_stage={3: CostModel(forward=1.5, backward=3.0, backward_input=1.5,
                                              backward_weight=1.5)})  # fmt: skip
    family = _Family(1, False, True)
    scheduler = _ListScheduler(4, 8, family, costs, [1.2] * 4, True, eager=True)
    rules = _rules(family, random.Random(0))
    assert all(scheduler.run(rule) is not None for rule in rules)
    assert any(scheduler.run(attrs.evolve(rule, owed=False)) is None for rule in rules)
    found = search(4, 8, num_chunks=1, split_backward=True, costs=costs, memory_limit=1.2,
                   recompute=True, method="heuristic", max_evaluations=40, eager=True)  # fmt: skip
    assert found.makespan == pytest.approx(41.5)
    assert found.bound == pytest.approx(41.5)


def test_list_scheduling_owes_a_recomputation_only_until_its_r_runs():
    """Under a limit of 1.2 microbatches a stage, stage 0 holds F0 and recomputes F1; once R1
    has rebuilt it (and B1 freed it) nothing is owed, so F2 holds its activation again: two
    recomputations, not a third for every forward after the first owed one."""
    import random

    from schedcc.search import _ListScheduler, _rules

    costs = CostModel(per_stage={0: CostModel(forward=1.3, backward=2.6, backward_input=1.3,
                                              backward_weight=1.3)})  # fmt: skip
    family = _Family(1, False, False)
    scheduler = _ListScheduler(2, 4, family, costs, [1.2, 1.2], True, eager=True)
    rule = _rules(family, random.Random(0))[0]
    assert rule.owed
    _, orders = scheduler.run(rule)
    assert orders[0] == ("F0", "F1", "B0", "R1", "B1", "F2", "F3", "B2", "R3", "B3")


def test_list_scheduling_may_recompute_a_stage_s_longest_held_chunk():
    """Under a tight limit on a heavy first stage, the V's stage 0 holds its first chunk's
    activations for the whole round trip: list scheduling that recomputes every forward of each
    stage's lowest chunk (`_Rule.recompute_lowest`) and holds the rest beats every rule that
    recomputes only where a forward does not fit, and the search finds it (p = 4, m = 8,
    1.2 microbatches a stage: the rules' best 36.4 with it, 38.7 without)."""
    import random

    from schedcc.search import _ListScheduler, _rules

    costs = CostModel(per_stage={0: CostModel(forward=1.3, backward=2.6, backward_input=1.3,
                                              backward_weight=1.3)})  # fmt: skip
    family = _Family(2, True, True)
    scheduler = _ListScheduler(4, 8, family, costs, [2.4] * 4, True, eager=True)
    rules = _rules(family, random.Random(0))
    greedy = min(made[0] for made in map(scheduler.run, rules) if made is not None)
    planned = [scheduler.run(attrs.evolve(rule, recompute_lowest=True)) for rule in rules]
    assert min(made[0] for made in planned if made is not None) < greedy - 2.0
    found = search(4, 8, num_chunks=2, placement="v", costs=costs, memory_limit=1.2,
                   recompute=True, method="heuristic", max_evaluations=60, eager=True)  # fmt: skip
    assert found.makespan < 37.0


@given(
    p=st.integers(2, 4),
    m=st.integers(2, 8),
    layout=st.sampled_from([(1, False), (2, False), (2, True)]),
    split=st.booleans(),
    limit=st.floats(0.5, 2.5),
    data=st.data(),
)
def test_list_scheduled_orders_validate_and_keep_to_their_budget(p, m, layout, split, limit, data):
    """Every order list scheduling makes under a limit, by every rule and every way of choosing
    what to recompute (`_variants`), with random per-stage costs, compiles (so validates),
    holds no more chunk activations on any stage than its budget when simulated, and never
    recomputes the last segment (its backward follows it on its stage: a recomputation would
    repeat it there)."""
    import random

    from strategies import stage_costs

    from schedcc.search import _found_class, _ListScheduler, _rules, _variants

    costs = data.draw(stage_costs(p))
    v, vshape = layout
    family = _Family(v, vshape, split)
    budgets = [limit * v] * p
    scheduler = _ListScheduler(p, m, family, costs, budgets, True)
    first = _rules(family, random.Random(0))[:8]
    again = [variant for rule in first for variant in _variants(rule, family, True)]
    made = 0
    for rule in first + again:
        result = scheduler.run(rule)
        if result is None:
            continue  # stuck under the budget: the search drops it
        made += 1
        schedule = _found_class(p, m, family, result[1])(p, m, v)
        timeline = schedcc.simulate(schedcc.compile(schedule), costs)
        assert max(timeline.peak_activations) <= budgets[0] + 1e-9, rule
        stage, chunk = family.segments(p)[-1]  # the loss's: its backward follows on the stage
        assert not any(
            isinstance(op, Recompute) and op.chunk == chunk for op in map(parse, result[1][stage])
        ), rule
    event("some rule made an order" if made else "every rule got stuck")


@given(
    p=st.integers(2, 4),
    m=st.integers(2, 6),
    limit=st.none() | st.floats(1.0, 3.0),
    data=st.data(),
)
def test_an_eager_search_is_never_slower_than_a_builtin_that_fits(p, m, limit, data):
    """Eagerly the built-ins are timed on the quick clock and only each layout's fastest
    simulated: under random per-stage costs, comm and limits, the order found in a tenth of a
    second (every built-in is timed whatever the time) is no slower than the fastest built-in
    `schedcc.tune` times eagerly within the limit."""
    costs = data.draw(stage_costs(p))
    try:
        found = search(p, m, costs=costs, memory_limit=limit, recompute=True, eager=True,
                       method="heuristic", time_limit=0.1)  # fmt: skip
    except ScheduleConfigError:
        return
    ranked = schedcc.tune(num_stages=p, num_microbatches=m, num_chunks=(1, 2), costs=costs,
                          memory_limit=limit, recompute=(False, True), eager=True).ranked
    assert found.makespan <= min(c.makespan for c in ranked) + 1e-9
