"""The compiler: arguments, each pass alone, update placement, all-or-nothing, the DAG.

The central property (docs/design.md, "The compiler"): every compute order that respects the data
dependencies lowers to a program that validates, for any shape, placement, data parallelism and
ZeRO level.
"""

from __future__ import annotations

import gc

import networkx as nx
import pytest
from _builtin_schedules import names
from _orders import OrderSchedule, random_orders
from hypothesis import given
from hypothesis import strategies as st

import schedcc
from schedcc import (
    Backward,
    DependencyError,
    Forward,
    GatherParams,
    OptimizerStep,
    Program,
    ReduceGrads,
    ScheduleConfigError,
    ScheduleError,
    UnmatchedCommError,
    validate,
)
from schedcc.compiler import computes
from schedcc.ir import SENDS, WEIGHT_GRADIENT, Comm, Compute
from schedcc.passes import assign_versions, build_graph, collect, insert_comm, insert_updates
from schedcc.registry import build_schedule, get_schedule
from schedcc.search import _compute_orders
from schedcc.semantics import Tensors, Units, match_comm, unit_durations, walk

_PARALLEL = st.sampled_from([(1, 0), (2, 0), (2, 1), (2, 2), (1, 1)])


@given(random_orders(), _PARALLEL)
def test_every_dependency_respecting_order_validates(schedule, parallel):
    """A random dependency-respecting compute order compiles to a program that validates."""
    data_parallel, zero = parallel
    program = schedcc.compile(schedule, data_parallel=data_parallel, zero=zero)
    assert validate(program, collect=True) == []
    _assert_updates_placed(program)


@given(random_orders(weight_delay=1, max_stages=4, max_microbatches=6), _PARALLEL)
def test_every_order_validates_with_weight_delay(schedule, parallel):
    """Random orders that start batch b + 1 before batch b's step validate with weight_delay 1."""
    data_parallel, zero = parallel
    program = schedcc.compile(schedule, data_parallel=data_parallel, zero=zero)
    assert validate(program, collect=True) == []


@given(random_orders(max_stages=4, max_microbatches=4, max_chunks=2))
def test_graph_is_a_dag_with_documented_edges(schedule):
    """Program.graph is a DAG: one node per instruction, order, comm and data edges."""
    program = schedcc.compile(schedule)
    graph = program.graph
    assert nx.is_directed_acyclic_graph(graph)
    assert graph.number_of_nodes() == program.num_instructions
    partner, _ = match_comm(program.stages, Tensors.of(schedule))
    for (s, pos), op in _ops(program, with_place=True):
        if pos:
            assert graph.has_edge((s, pos - 1), (s, pos))
        if isinstance(op, SENDS):
            assert graph.edges[(s, pos), partner[s][pos]]["kind"] == "comm"
    node = {
        (op.code, op.microbatch, schedule.segment_of(s, op.chunk)): (s, pos)
        for (s, pos), op in _ops(program, with_place=True)
        if isinstance(op, Compute)
    }
    for i in range(schedule.num_microbatches_total):
        for k in range(schedule.num_segments):
            if k + 1 < schedule.num_segments:
                assert graph.edges[node["F", i, k], node["F", i, k + 1]]["kind"] == "data"
            backward = node.get(("B", i, k)) or node["I", i, k]
            assert graph.has_edge(node["F", i, k], backward)
            if ("W", i, k) in node:
                assert graph.has_edge(node["I", i, k], node["W", i, k])


def _ops(program: Program, with_place: bool = False):
    for s, ops in enumerate(program.stages):
        for pos, op in enumerate(ops):
            yield ((s, pos), op) if with_place else (s, op)


def _assert_updates_placed(program: Program) -> None:
    """Reduce/Step/Gather sit where docs/design.md says, on every stage and batch."""
    schedule = program.schedule
    m, v = schedule.num_microbatches, schedule.num_chunks
    reduce = program.data_parallel > 1 or program.zero > 0
    for ops in program.stages:
        steps = [pos for pos, op in enumerate(ops) if isinstance(op, OptimizerStep)]
        assert len(steps) == schedule.num_batches
        for batch, step in enumerate(steps):
            begin = steps[batch - 1] if batch else -1
            window = range(begin + 1, step)
            reduced = [pos for pos in window if isinstance(ops[pos], ReduceGrads)]
            grads = [
                pos
                for pos, op in enumerate(ops)
                if isinstance(op, WEIGHT_GRADIENT) and op.microbatch // m == batch
            ]
            if not reduce:
                assert not reduced
            elif program.zero == 2:  # a reduce-scatter right after every weight gradient
                assert len(reduced) == len(grads)
                for pos in grads:
                    after = next(
                        q for q in range(pos + 1, len(ops)) if not isinstance(ops[q], Comm)
                    )
                    assert ops[after] == ReduceGrads(ops[pos].chunk)
            else:  # one per chunk, right after (past comm) its last weight gradient
                assert sorted(ops[pos].chunk for pos in reduced) == list(range(v))
                for pos in reduced:
                    c = ops[pos].chunk
                    last = max(q for q in grads if ops[q].chunk == c)
                    between = ops[last + 1 : pos]
                    assert not any(isinstance(op, Compute) for op in between)
            gathers = [op for op in ops[step + 1 : step + 1 + v] if isinstance(op, GatherParams)]
            assert len(gathers) == (v if program.zero >= 1 else 0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_bad_data_parallel(bad):
    """data_parallel must be a positive integer: ScheduleConfigError naming it."""
    with pytest.raises(ScheduleConfigError, match="data_parallel must be a positive integer"):
        schedcc.compile(schedcc.get_schedule("gpipe")(2, 2), data_parallel=bad)


@pytest.mark.parametrize("bad", [-1, 4, 1.0, True, "1", None])
def test_bad_zero(bad):
    """zero must be 0, 1, 2 or 3: ScheduleConfigError naming it."""
    with pytest.raises(ScheduleConfigError, match="zero must be 0, 1, 2 or 3"):
        schedcc.compile(schedcc.get_schedule("gpipe")(2, 2), zero=bad)


def test_compile_needs_a_schedule_instance():
    """Passing the class instead of an instance says how to construct one."""
    with pytest.raises(ScheduleConfigError, match="needs a Schedule instance"):
        schedcc.compile(schedcc.get_schedule("gpipe"))


class _ForwardSubclass(Forward):
    """Not an instruction the passes know: subclasses are rejected, not half-understood."""

    __slots__ = ()


@pytest.mark.parametrize(
    ("yielded", "match"),
    [
        ("F0", "is not a schedcc instruction"),
        (Compute(0), "is not a schedcc instruction"),
        (_ForwardSubclass(0), "is not a schedcc instruction"),
        (Forward(2), "microbatch 2; it must be an int in \\[0, 2\\)"),
        (Forward(-1), "microbatch -1"),
        (Forward(0, chunk=1), "chunk 1; it must be an int in \\[0, 1\\)"),
        (ReduceGrads(3), "chunk 3"),
    ],
)
def test_collect_rejects_bad_yields(yielded, match):
    """collect names the stage and position of anything that is not a valid instruction."""
    orders = [[Forward(0), Forward(1)], [Forward(0), yielded]]
    with pytest.raises(ScheduleError, match=f"stage 1, position 1: .*{match}") as info:
        collect(OrderSchedule(2, 2, orders=orders))
    assert (info.value.stage, info.value.position) == (1, 1)


def test_each_pass_alone():
    """collect, insert_comm, insert_updates, assign_versions run alone; each adds its part."""
    one_batch = insert_comm(collect(schedcc.get_schedule("1f1b")(3, 4)))
    problems = validate(one_batch, collect=True)
    assert len(problems) == 3
    assert all("OptimizerStep" in str(e) for e in problems)
    assert validate(insert_updates(one_batch), collect=True) == []

    schedule = schedcc.get_schedule("1f1b")(3, 4, num_batches=2)
    program = collect(schedule, data_parallel=2, zero=1)
    assert all(isinstance(op, Compute) for _, op in _ops(program))
    with_comm = insert_comm(program)
    assert {op.group for _, op in _ops(with_comm)} == {"compute", "comm"}
    assert all(isinstance(e, ScheduleError) for e in validate(with_comm, collect=True))
    with_updates = insert_updates(with_comm)
    assert validate(with_updates, collect=True) == []
    assert with_updates.versions is None
    versioned = assign_versions(with_updates)
    assert validate(versioned, collect=True) == []
    for ops, versions in zip(versioned.stages, versioned.versions):
        steps = [v for op, v in zip(ops, versions) if isinstance(op, OptimizerStep)]
        assert steps == [1, 2]
        for op, version in zip(ops, versions):
            if isinstance(op, Compute):
                assert version == op.microbatch // 4
    assert nx.is_directed_acyclic_graph(build_graph(versioned))
    assert schedcc.compile(schedule, data_parallel=2, zero=1).stages == versioned.stages


def test_updates_placement_by_example():
    """Reduce per chunk after its last backward (past the comm), Step, then Gather under ZeRO-1."""
    schedule = schedcc.get_schedule("gpipe")(2, 2)
    assert schedcc.compile(schedule).stages[1][-1:] == (OptimizerStep(),)
    zero1 = schedcc.compile(schedule, data_parallel=2, zero=1)
    assert zero1.to_text().splitlines()[1] == (
        "stage 1: RA0 F0 RA1 F1 B1 SG1 B0 SG0 Reduce Step Gather"
    )
    zero2 = schedcc.compile(schedule, data_parallel=2, zero=2)
    assert zero2.to_text().splitlines()[1] == (
        "stage 1: RA0 F0 RA1 F1 B1 SG1 Reduce B0 SG0 Reduce Step Gather"
    )


GPIPE_OWN_COMM = [
    [Forward(0), "SA0", Forward(1), "SA1", "RG1", Backward(1), "RG0", Backward(0)],
    ["RA0", Forward(0), "RA1", Forward(1), Backward(1), "SG1", Backward(0), "SG0"],
]


def _own(orders) -> list[list]:
    return [[schedcc.ir.parse(op) if isinstance(op, str) else op for op in ops] for ops in orders]


def test_schedule_that_yields_comm_owns_all_of_it():
    """With any comm yielded, the compiler inserts none; a complete set validates as given."""
    schedule = OrderSchedule(2, 2, orders=_own(GPIPE_OWN_COMM))
    program = schedcc.compile(schedule)
    assert [ops[:-1] for ops in program.stages] == [tuple(ops) for ops in schedule.orders]
    partial = _own(GPIPE_OWN_COMM)
    partial[1].remove(schedcc.ir.parse("SG1"))
    with pytest.raises(ScheduleError):
        schedcc.compile(OrderSchedule(2, 2, orders=partial))
    one_only = [[Forward(0), Backward(0), Forward(1), Backward(1)], _own(GPIPE_OWN_COMM)[1]]
    errors = validate(insert_comm(collect(OrderSchedule(2, 2, orders=one_only))), collect=True)
    assert any(isinstance(e, UnmatchedCommError) for e in errors)


def test_schedule_that_yields_updates_owns_all_of_them():
    """With any update yielded, the compiler inserts none and the validator checks them."""
    orders = [[Forward(0), Backward(0), OptimizerStep()]]
    program = schedcc.compile(OrderSchedule(1, 1, orders=orders))
    assert program.stages == ((Forward(0), Backward(0), OptimizerStep()),)
    with pytest.raises(DependencyError, match="put ReduceGrads for them before it"):
        schedcc.compile(OrderSchedule(1, 1, orders=orders), data_parallel=2)
    early = [[Forward(0), OptimizerStep(), Backward(0)]]
    with pytest.raises(DependencyError, match="only 0 of its 1 weight gradients"):
        schedcc.compile(OrderSchedule(1, 1, orders=early))


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (5, 7)])
def test_1f1b_pairs_send_activation_with_recv_grad(p, m):
    """In 1F1B's steady state each send-activation shares one comm group with a recv-grad."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(p, m))
    units = Units.of(program.stages)
    for s in range(p - 1):
        ops = program.stages[s]
        paired = 0
        for (lo, hi), is_group in zip(units.bounds[s], units.is_group[s]):
            codes = {op.code for op in ops[lo:hi]}
            if is_group and codes == {"SA", "RG"}:
                paired += 1
        assert paired == m - (p - s - 1), (s, program.to_text())


@pytest.mark.parametrize("enabled", [True, False])
def test_compile_restores_the_garbage_collector(enabled):
    """compile and validate pause the cyclic collector and leave it as they found it."""
    was = gc.isenabled()
    try:
        if not enabled:
            gc.disable()
        program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 2))
        assert gc.isenabled() is enabled
        with pytest.raises(DependencyError):
            validate(program.evolve(stages=(program.stages[0][::-1], program.stages[1])))
        assert gc.isenabled() is enabled
    finally:
        if was:
            gc.enable()


def test_comm_meets_where_both_stages_are_idle():
    """Interleaved 1F1B at p=4 replays the compute-only makespan 3mv + 3(p - 1) exactly."""
    from schedcc.simulate import simulate

    p, m, v = 4, 8, 2
    program = schedcc.compile(schedcc.get_schedule("interleaved-1f1b")(p, m, v))
    assert simulate(program).makespan == 3 * m * v + 3 * (p - 1)


def test_comm_placement_moves_pairs_back_to_a_common_idle_moment():
    """At p=8 comm placement keeps interleaving near its ideal 213: 225, not 294 as before."""
    from schedcc.simulate import simulate

    program = schedcc.compile(schedcc.get_schedule("interleaved-1f1b")(8, 32, 2))
    assert simulate(program).makespan <= 225


def test_interleaving_beats_1f1b_under_blocking_exchanges():
    """At p=8, m=32 interleaved 1F1B (v=2) has a smaller simulated bubble than 1F1B."""
    from schedcc.simulate import simulate

    one = simulate(schedcc.compile(schedcc.get_schedule("1f1b")(8, 32)))
    two = simulate(schedcc.compile(schedcc.get_schedule("interleaved-1f1b")(8, 32, 2)))
    assert two.bubble_fraction < one.bubble_fraction


@given(random_orders())
def test_both_lowerings_keep_their_timing_promises(schedule):
    """A lowering whose pairs all met at common idle moments replays the compute-only makespan,
    and the makespan each lowering reports (the first one timed as it appends) is what the step
    model simulates."""
    import importlib

    lowering = importlib.import_module("schedcc.passes.insert_comm")
    program = collect(schedule)
    tensors = Tensors.of(schedule)
    plan = lowering._Plan(program, tensors)
    start = lowering._simulate(program, plan)
    ideal = max(
        (t + c for row, costs in zip(start, plan.costs) for t, c in zip(row, costs)), default=0
    )
    stages, exact, first = lowering._lower(program, plan, start)
    assert first == _rendezvous_makespan(stages, tensors)  # timed as it was appended
    if exact:
        assert first == ideal
    online, makespan = lowering._lower_online(program, plan)
    assert _rendezvous_makespan(online, tensors) == makespan
    assert makespan >= ideal


def _rendezvous_makespan(stages, tensors) -> float:
    """The rendezvous model's makespan under the default costs with free comm."""
    units = Units.of(stages)
    partner, problems = match_comm(stages, tensors)
    assert not problems
    result = walk(units, partner, unit_durations(stages, units))
    assert not result.stuck
    return max((row[-1] for row in result.end if row), default=0)


@pytest.mark.parametrize("name", names())
@pytest.mark.parametrize("recompute", [False, True])
def test_computes_run_in_the_order_compile_gives_them(name, recompute):
    """`computes` (what a search times before it compiles) has every built-in's computes in
    the order the compiled program runs them, with or without full recomputation, at v = 1
    and 2 (copies to the host are placed beside them by lowering: a search compiles an order
    with copies before it times it)."""

    def computes_only(orders):
        return tuple(tuple(t for t in row if t[0] not in "OL") for row in orders)

    for p, m, v in ((2, 4, 1), (4, 8, 2)):
        try:
            schedule = build_schedule(get_schedule(name), p, m, num_chunks=v)
            program = schedcc.compile(schedule, recompute=recompute)
        except ScheduleError:
            continue
        collected = _compute_orders(computes(schedule, recompute=recompute))
        assert computes_only(collected) == computes_only(_compute_orders(program))
