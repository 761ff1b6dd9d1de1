"""The built-in schedules: each is registered, validates and trains exactly over the shapes it
accepts (the properties every built-in shares, over tests/_builtin_schedules.py's table), with the
expected instruction counts, activation peaks and weight versions; interleaved 1F1B equals
Megatron-LM's order; each configuration rule raises a readable `ScheduleConfigError`."""

from __future__ import annotations

from collections import Counter

import pytest
from _builtin_schedules import BUILTINS, names
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import BUILTIN_SCHEDULES, shapes

import schedcc
from schedcc import Backward, Forward, ScheduleConfigError, WeightVersionError
from schedcc.costs import CostModel
from schedcc.passes import collect
from schedcc.registry import registered_classes
from schedcc.schedules.interleaved import Interleaved1F1B
from schedcc.schedules.one_f_one_b import OneFOneB
from schedcc.schedules.pipedream_2bw import PipeDream2BW
from schedcc.simulate import simulate
from schedcc.testing import check_schedule


def _peak_activations(ops) -> int:
    held = peak = 0
    for op in ops:
        held += 1 if op.code == "F" else -1 if op.code == "B" else 0
        peak = max(peak, held)
    return peak


def test_the_table_names_every_registered_schedule():
    """tests/_builtin_schedules.py lists each registered class once, under its own name."""
    classes = set(registered_classes().values())
    assert {schedcc.get_schedule(name) for name in BUILTIN_SCHEDULES} == classes
    assert len(BUILTIN_SCHEDULES) == len(classes)


@pytest.mark.parametrize("name", BUILTIN_SCHEDULES)
def test_registered_by_name(name):
    """Each built-in is found by its name through the entry-point registry."""
    assert schedcc.get_schedule(name).name == name
    assert name in schedcc.available_schedules()


@pytest.mark.parametrize("builtin", BUILTINS, ids=lambda b: b.name)
def test_validates_over_the_shapes_it_accepts(builtin):
    """Each compiles, validates and simulates over random shapes it accepts, with data
    parallelism and ZeRO-1 too."""
    cls = schedcc.get_schedule(builtin.name)
    examples = settings().max_examples
    stages, microbatches = builtin.validate_bounds
    check_schedule(
        cls, max_examples=examples, max_stages=stages, max_microbatches=microbatches,
        max_chunks=builtin.max_chunks,
    )  # fmt: skip
    check_schedule(
        cls, max_examples=max(3, examples // 3), max_stages=4, max_microbatches=10,
        max_chunks=builtin.max_chunks, data_parallel=2, zero=1,
    )  # fmt: skip


@pytest.mark.parametrize("builtin", BUILTINS, ids=lambda b: b.name)
def test_trains_like_non_pipelined_over_random_shapes(builtin):
    """On the local backend in float64, each equals non-pipelined training to 1e-10 over random
    shapes it accepts (two batches a program at most)."""
    pytest.importorskip("torch")
    stages, microbatches = builtin.train_bounds
    check_schedule(
        schedcc.get_schedule(builtin.name), max_examples=max(2, settings().max_examples // 5),
        max_stages=stages, max_microbatches=microbatches, max_chunks=builtin.max_chunks,
        max_batches=2, numerics=True,
    )  # fmt: skip


@pytest.mark.parametrize("name", names(backward="B", placement="looped"))
@given(data=st.data())
def test_builtin_compiles_with_expected_counts(name, data):
    """Each stage runs m * v * batches forwards and backwards and one step per batch, and every
    segment boundary moves one activation and one gradient per microbatch."""
    cls = schedcc.get_schedule(name)
    shape = data.draw(shapes(cls))
    schedule = shape.build(cls)
    program = schedcc.compile(schedule)
    per_stage = shape.num_microbatches * shape.num_chunks * shape.num_batches
    for ops in program.stages:
        counts = Counter(op.code for op in ops)
        assert counts["F"] == counts["B"] == per_stage
        assert counts["Step"] == shape.num_batches
        assert counts["Reduce"] == 0
    crossings = (shape.num_stages * shape.num_chunks - 1) * shape.num_microbatches
    expected = crossings * shape.num_batches if shape.num_stages > 1 else 0
    totals = Counter(op.code for ops in program.stages for op in ops)
    assert totals["SA"] == totals["RA"] == totals["SG"] == totals["RG"] == expected


@pytest.mark.parametrize("builtin", BUILTINS, ids=lambda b: b.name)
@settings(suppress_health_check=[HealthCheck.filter_too_much])  # v and m >= 2p are drawn, then kept
@given(data=st.data())
def test_builtin_reduces_each_chunk_once_per_batch_with_data_parallel(builtin, data):
    """With two data-parallel replicas each stage reduces every chunk once per batch."""
    cls = schedcc.get_schedule(builtin.name)
    shape = data.draw(shapes(cls, max_stages=4, max_microbatches=builtin.train_bounds[1]))
    program = schedcc.compile(shape.build(cls), data_parallel=2)
    for ops in program.stages:
        assert Counter(op.code for op in ops)["Reduce"] == shape.num_chunks * shape.num_batches


@pytest.mark.parametrize("builtin", BUILTINS, ids=lambda b: b.name)
@settings(suppress_health_check=[HealthCheck.filter_too_much])  # v and m >= 2p are drawn, then kept
@given(data=st.data())
def test_builtin_uses_the_versions_its_weight_delay_says(builtin, data):
    """A compute of batch b uses version max(0, b - weight_delay) and step n produces n + 1."""
    cls = schedcc.get_schedule(builtin.name)
    shape = data.draw(shapes(cls, max_stages=4, max_microbatches=builtin.train_bounds[1]))
    program = schedcc.compile(shape.build(cls))
    m, delay = shape.num_microbatches, cls.weight_delay
    for ops, versions in zip(program.stages, program.versions):
        steps = 0
        for op, version in zip(ops, versions):
            if op.group == "compute":
                assert version == max(0, op.microbatch // m - delay)
            elif op.code == "Step":
                steps += 1
                assert version == steps


@given(shape=shapes(OneFOneB))
def test_1f1b_holds_at_most_p_minus_s_activations(shape):
    """1F1B's stage s holds min(p - s, m) microbatch activations at its peak."""
    program = collect(shape.build(OneFOneB))
    for s, ops in enumerate(program.stages):
        assert _peak_activations(ops) == min(shape.num_stages - s, shape.num_microbatches)


@given(shape=shapes(PipeDream2BW))
def test_2bw_holds_at_most_p_minus_s_activations_over_all_batches(shape):
    """2BW's stage s holds min(p - s, batches * m) activations: no flush, same 1F1B peak."""
    program = collect(shape.build(PipeDream2BW))
    total = shape.num_microbatches * shape.num_batches
    for s, ops in enumerate(program.stages):
        assert _peak_activations(ops) == min(shape.num_stages - s, total)


@given(shape=shapes(Interleaved1F1B))
def test_interleaved_peak_is_warmup_plus_one(shape):
    """Interleaved 1F1B's stage s holds min(warm-up + 1, m * v) chunk activations at its peak."""
    schedule = shape.build(Interleaved1F1B)
    program = collect(schedule)
    total = shape.num_microbatches * shape.num_chunks
    for s, ops in enumerate(program.stages):
        assert _peak_activations(ops) == min(schedule.num_warmup(s) + 1, total)


def test_2bw_carries_the_steady_state_across_batches():
    """In 2BW, stage 0 forwards batch 1 before it finishes batch 0's backwards (no flush)."""
    ops = collect(PipeDream2BW(4, 4, num_batches=2)).stages[0]
    first_forward_of_batch_1 = ops.index(Forward(4))
    last_backward_of_batch_0 = ops.index(Backward(3))
    assert first_forward_of_batch_1 < last_backward_of_batch_0


def test_2bw_variant_needing_three_versions_is_rejected():
    """A 2BW variant whose warm-up runs two batches ahead fails with WeightVersionError."""

    class TooFarAhead(PipeDream2BW):
        name = "2bw-too-far-ahead"

        def num_warmup(self, stage):
            ahead = 2 * self.num_microbatches + self.num_stages - stage - 1
            return min(ahead, self.num_microbatches_total)

    with pytest.raises(WeightVersionError, match="needs weight version 1"):
        schedcc.compile(TooFarAhead(4, 4, num_batches=3))


def _megatron_order(p: int, m: int, v: int, rank: int) -> list[str]:
    """Megatron-LM's interleaved loop for one rank, re-implemented independently.

    Classic `forward_backward_pipelining_with_interleaving`: chunk of virtual microbatch k is
    `(k % (p * v)) // p` (reversed for backwards), each chunk takes its microbatches in FIFO
    order, and `m == p` runs all forwards first.
    """
    total = m * v
    warmup = total if m == p else min((p - rank - 1) * 2 + (v - 1) * p, total)
    taken = {"F": [0] * v, "B": [0] * v}
    order: list[str] = []

    def run(code: str, k: int) -> None:
        chunk = (k % (p * v)) // p
        if code == "B":
            chunk = v - 1 - chunk
        cls = Forward if code == "F" else Backward
        order.append(str(cls(taken[code][chunk], chunk)))
        taken[code][chunk] += 1

    for k in range(warmup):
        run("F", k)
    for k in range(total - warmup):
        run("F", k + warmup)
        run("B", k)
    for k in range(total - warmup, total):
        run("B", k)
    return order


def _megatron_core_order(p: int, m: int, v: int, rank: int) -> list[str]:
    """Recent Megatron-LM (megatron/core/pipeline_parallel/schedules.py), re-implemented.

    `get_schedule_table` with `microbatch_group_size_per_vp_stage = p` gives each virtual
    microbatch its (microbatch, chunk); `get_pp_rank_microbatches` gives the warm-up, with no
    special case for m == p; backwards reverse the chunk and pop each chunk's microbatches FIFO.
    """
    table = [
        (i, chunk)
        for start in range(0, m, p)
        for chunk in range(v)
        for i in range(start, m if start + p >= m else start + p)
    ]
    total = m * v
    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    popped = [0] * v
    order: list[str] = []

    def backward(k: int) -> None:
        chunk = v - 1 - table[k][1]
        order.append(str(Backward(popped[chunk], chunk)))
        popped[chunk] += 1

    order += [str(Forward(i, chunk)) for i, chunk in table[:warmup]]
    for k in range(total - warmup):
        order.append(str(Forward(*table[warmup + k])))
        backward(k)
    for k in range(total - warmup, total):
        backward(k)
    return order


@given(p=st.integers(2, 8), groups=st.integers(2, 4), v=st.integers(2, 4))
def test_interleaved_equals_classic_megatron_where_it_accepts(p, groups, v):
    """For m a multiple of p above p and v >= 2, each stage's order is exactly classic
    Megatron-LM's (at m == p classic Megatron-LM ran all forwards first; recent Megatron-LM and
    torch do not, and neither does schedcc)."""
    m = p * groups
    program = collect(Interleaved1F1B(p, m, v))
    for rank, ops in enumerate(program.stages):
        assert [str(op) for op in ops] == _megatron_order(p, m, v, rank)


@given(p=st.integers(2, 8), groups=st.integers(1, 4), v=st.integers(2, 4))
def test_interleaved_equals_megatron_core_where_it_accepts(p, groups, v):
    """For m a multiple of p (m == p included), each stage's order is exactly recent
    Megatron-LM's."""
    m = p * groups
    program = collect(Interleaved1F1B(p, m, v))
    for rank, ops in enumerate(program.stages):
        assert [str(op) for op in ops] == _megatron_core_order(p, m, v, rank)


def _torch_order(p: int, m: int, v: int, rank: int) -> list[str]:
    """torch's `ScheduleInterleaved1F1B` order for one rank, from its own private helpers."""
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    per_round = m // max(1, m // p)
    warmup = torch_schedules._get_warmup_ops(rank, v, per_round, p, m, multiply_factor=2)
    steady = v * m - warmup

    def forward_stage(step: int) -> int:
        return ((step // per_round) % v) * p + rank

    def backward_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

    actions = torch_schedules._get_1f1b_rank_ops(
        v, p, warmup, steady, warmup, rank, forward_stage, backward_stage
    )
    forward = torch_schedules._ComputationType.FORWARD
    order = []
    for action in filter(None, actions):
        cls = Forward if action.computation_type == forward else Backward
        order.append(str(cls(action.microbatch_index, action.stage_index // p)))
    return order


@pytest.mark.parametrize(
    ("p", "m", "v"),
    [
        (2, 1, 2),
        (2, 2, 2),
        (2, 4, 3),
        (3, 2, 2),
        (4, 3, 2),
        (4, 4, 2),
        (4, 4, 3),
        (4, 6, 3),
        (4, 8, 2),
        (4, 10, 2),
        (4, 12, 4),
        (5, 7, 2),
        (8, 8, 2),
        (8, 16, 2),
        (8, 18, 3),
        (8, 32, 4),
    ],
)
def test_interleaved_equals_torch_where_torch_accepts(p, m, v):
    """Where torch accepts the shape (m a multiple of its rounds), torch's order."""
    program = collect(Interleaved1F1B(p, m, v))
    for rank, ops in enumerate(program.stages):
        assert [str(op) for op in ops] == _torch_order(p, m, v, rank)


def test_interleaved_m_equal_p_starts_1f1b_early_at_the_same_makespan():
    """At m == p the later stages start 1F1B before their last forward (as recent Megatron-LM
    and torch do), holding fewer activations than all-forwards-first, in the ideal makespan."""
    program = schedcc.compile(Interleaved1F1B(4, 4, 3))
    codes = ["".join(op.code for op in ops if op.group == "compute") for ops in program.stages]
    assert codes[0] == "F" * 12 + "B" * 12
    assert codes[3] == "F" * 8 + "FB" * 4 + "B" * 8
    timeline = simulate(program, CostModel(forward=1, backward=2))
    assert timeline.makespan == 3 * (3 * 4 + 4 - 1)
    assert timeline.peak_activations == (12, 12, 11, 9)


@given(shape=shapes(Interleaved1F1B, max_chunks=1))
def test_interleaved_with_one_chunk_is_1f1b(shape):
    """Interleaved 1F1B with v = 1 runs exactly the 1F1B order."""
    interleaved = collect(shape.build(Interleaved1F1B)).stages
    assert interleaved == collect(shape.build(OneFOneB)).stages


def test_interleaved_flushes_between_batches():
    """Interleaved 1F1B finishes every backward of batch 0 before any forward of batch 1."""
    for ops in collect(Interleaved1F1B(4, 8, 2, num_batches=2)).stages:
        last_of_batch_0 = max(pos for pos, op in enumerate(ops) if op.microbatch < 8)
        first_of_batch_1 = min(pos for pos, op in enumerate(ops) if op.microbatch >= 8)
        assert last_of_batch_0 < first_of_batch_1


@pytest.mark.parametrize(
    ("name", "args", "words"),
    [
        ("1f1b", (4, 8, 2), "num_chunks"),
        ("2bw", (4, 8, 2), "num_chunks"),
        ("2bw", (4, 2, 1, 3), "num_microbatches >= num_stages - 1"),
        ("gpipe", (0, 8), "num_stages must be a positive integer"),
        ("interleaved-1f1b", (4, 8, 0), "num_chunks must be a positive integer"),
        ("interleaved-1f1b", (4, 8, 2, True), "num_batches must be a positive integer"),
    ],
)
def test_config_rule_raises_readable_error(name, args, words):
    """Each configuration rule raises ScheduleConfigError naming the argument and the rule."""
    with pytest.raises(ScheduleConfigError, match=words):
        schedcc.get_schedule(name)(*args)


@pytest.mark.parametrize("name", BUILTIN_SCHEDULES)
def test_class_docstring_gives_a_one_line_description(name):
    """`schedcc list` shows a one-line description for each built-in schedule."""
    description = schedcc.get_schedule(name).description()
    assert description
    assert len(description) < 100


class _ShortWarmup(Interleaved1F1B):
    """Interleaved 1F1B with one warm-up forward fewer on stage 0 (at p = 2)."""

    def num_warmup(self, stage: int) -> int:
        return super().num_warmup(stage) - (stage == 0)


class _GroupsOfFour(Interleaved1F1B):
    """Interleaved 1F1B whose forwards go through the chunks four microbatches at a time."""

    def groups(self) -> list[range]:
        m = self.num_microbatches
        return [range(i, min(i + 4, m)) for i in range(0, m, 4)]


def test_two_stage_interleaved_in_groups_of_four_reaches_the_ideal():
    """[Note: interleaved at two stages]: p = 2, v = 2, m = 8 in groups of four takes the ideal
    51 units (Megatron-LM's groups of two: 57) and holds two more activations on each stage."""
    costs = CostModel(forward=1, backward=2)
    fours = schedcc.compile(_GroupsOfFour(2, 8, 2))
    twos = schedcc.compile(Interleaved1F1B(2, 8, 2))
    rendezvous = simulate(fours, costs), simulate(twos, costs)
    assert (rendezvous[0].makespan, rendezvous[1].makespan) == (51, 57)
    eager = simulate(fours, costs, eager=True), simulate(twos, costs, eager=True)
    assert (eager[0].makespan, eager[1].makespan) == (51, 51)  # sends that never wait
    peaks = rendezvous[0].peak_activations, rendezvous[1].peak_activations
    assert [a - b for a, b in zip(*peaks)] == [2, 2]


@given(m=st.integers(4, 24), v=st.integers(2, 4), backward=st.sampled_from([1, 1.5, 2, 3]))
def test_two_stage_interleaved_idles_beyond_the_ideal_only_under_rendezvous(m, v, backward):
    """[Note: interleaved at two stages]: at p = 2, m > p, under rendezvous exchanges one warm-up
    forward fewer on stage 0 reaches the ideal makespan (F + B) * (v * m + 1) and holds one
    activation fewer there, while Megatron-LM's warm-up idles beyond it wherever Megatron-LM
    accepts the shape (m % p == 0); with sends that never wait, Megatron-LM's order takes the
    ideal too."""
    costs = CostModel(forward=1, backward=backward)
    ideal = (1 + backward) * (v * m + 1)
    program = schedcc.compile(Interleaved1F1B(2, m, v))
    megatron = simulate(program, costs)
    short = simulate(schedcc.compile(_ShortWarmup(2, m, v)), costs)
    assert short.makespan == pytest.approx(ideal)
    assert megatron.makespan >= short.makespan
    if m % 2 == 0:
        assert megatron.makespan > ideal
        assert simulate(program, costs, eager=True).makespan == pytest.approx(ideal)
    assert short.peak_activations[0] == megatron.peak_activations[0] - 1
    assert short.peak_activations[1] == megatron.peak_activations[1]
