"""`Program.graph` holds the waits of collectives and rendezvous: the n-th `ReduceTied(g)` of a
member and the n-th `GradNorm` of a stage wait for the other members' ops before theirs, a
send for its receive's comm group to be posted ([Note: waits in the graph]), so the graph is
acyclic exactly when the validator finds no deadlock."""

from __future__ import annotations

import networkx as nx
import pytest
from _orders import OrderSchedule, random_orders
from hypothesis import given
from hypothesis import strategies as st

import schedcc
from schedcc.errors import DeadlockError, ScheduleConfigError
from schedcc.ir import GradNorm, ReduceTied, parse
from schedcc.passes import assign_versions
from schedcc.semantics import Units
from schedcc.semantics.collectives import match_collectives
from schedcc.semantics.layout import Layout
from schedcc.semantics.norms import match_norms

_COLLECTIVES = (ReduceTied, GradNorm)


def _order(text: str) -> list:
    return [parse(x) for x in text.split()]


def _deadlocks(program) -> bool:
    return any(isinstance(e, DeadlockError) for e in schedcc.validate(program, collect=True))


def _moved(program, stage: int, src: int, dst: int):
    """`program` with the op at `(stage, src)` moved to position `dst`, versions assigned."""
    stages = [list(ops) for ops in program.stages]
    stages[stage].insert(dst, stages[stage].pop(src))
    return assign_versions(program.evolve(stages=tuple(map(tuple, stages)), versions=None))


def _expected_collective_edges(program) -> set:
    """From the op before each other member's step to each member of each collective."""
    units = Units.of(program.stages)
    tables = [match_norms(program.stages)[0]]
    if program.tied:
        layout = Layout.of(program.schedule)
        tables.append(match_collectives(program.stages, program.tied, layout)[0])
    edges = set()
    for meets in tables:
        for s, row in enumerate(meets):
            for pos, others in enumerate(row):
                for t, q in others or ():
                    start = units.bounds[t][units.unit_at[t][q]][0]
                    if start:
                        edges.add(((t, start - 1), (s, pos)))
    return edges


def _edges(graph, kind: str) -> set:
    return {(u, v) for u, v, k in graph.edges(data="kind") if k == kind}


def test_a_tie_across_stages_adds_an_edge_each_way():
    """gpipe p=2 tied: each stage's Tied0 waits for the op before the other's."""
    program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 1), tied=[(0, 1)])
    assert _edges(program.graph, "collective") == {((0, 3), (1, 4)), ((1, 3), (0, 4))}


def test_a_norm_that_deadlocks_is_a_cycle_of_the_graph():
    """Stage 1's norm moved before its gradient send: stage 0 reaches its norm only through
    that send's receive. The validator reports the deadlock; the graph has a cycle through the
    collective edge, and none without it."""
    program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 1), grad_norm=True)
    assert nx.is_directed_acyclic_graph(program.graph)
    bad = _moved(program, 1, program.stages[1].index(GradNorm()), 3)
    assert bad.to_text().splitlines()[1] == "stage 1: RA0 F0 B0 Norm SG0 Step"
    with pytest.raises(DeadlockError):
        schedcc.validate(bad)
    graph = bad.graph
    cycle = nx.find_cycle(graph)
    assert "collective" in {graph.edges[u, v]["kind"] for u, v in cycle}
    graph.remove_edges_from(list(_edges(graph, "collective")))
    assert nx.is_directed_acyclic_graph(graph)


def test_a_tie_placed_before_the_next_batchs_send_is_a_cycle():
    """Under a weight delay stage 0's batch-0 tie needs stage 1's SG1: with stage 1's Tied0 and
    Step before F1 (right after W0) the validator finds a deadlock and the graph a cycle."""
    schedule = OrderSchedule(2, 1, 1, 2, weight_delay=1)
    schedule.orders = [_order("F0 F1 I0 I1 W0 W1"), _order("F0 I0 W0 F1 I1 W1")]
    program = schedcc.compile(schedule, tied=[(0, 1)])
    assert nx.is_directed_acyclic_graph(program.graph)
    ops = program.stages[1]
    early = _moved(_moved(program, 1, ops.index(ReduceTied(0)), 5), 1, ops.index(parse("Step")), 6)
    assert early.to_text().splitlines()[1].startswith("stage 1: RA0 F0 I0 SG0 W0 Tied0 Step RA1")
    with pytest.raises(DeadlockError):
        schedcc.validate(early)
    assert not nx.is_directed_acyclic_graph(early.graph)


@given(
    st.sampled_from([0, 1]).flatmap(
        lambda d: random_orders(weight_delay=d, max_stages=3, max_microbatches=3, max_chunks=2)
    ),
    st.booleans(),
    st.data(),
)
def test_collective_edges_and_deadlocks_on_random_programs(schedule, tie, data):
    """Random orders with a tie of the first and last segment and/or grad_norm: an accepted
    program's graph is acyclic and holds every collective edge; with one collective moved
    elsewhere on its stage, the graph has a cycle exactly when the validator finds a deadlock."""
    n = schedule.num_segments
    tied = [(0, n - 1)] if tie and n > 1 else []
    try:
        program = schedcc.compile(schedule, tied=tied, grad_norm=True)
    except ScheduleConfigError:
        return  # refused: a norm or tie that fits no consistent cut
    graph = program.graph
    assert nx.is_directed_acyclic_graph(graph)
    expected = _expected_collective_edges(program)
    assert _edges(graph, "collective") == expected
    assert expected or schedule.num_stages == 1
    places = [
        (s, pos)
        for s, ops in enumerate(program.stages)
        for pos, op in enumerate(ops)
        if type(op) in _COLLECTIVES
    ]
    s, pos = data.draw(st.sampled_from(places))
    dst = data.draw(st.integers(0, len(program.stages[s]) - 1))
    mutant = _moved(program, s, pos, dst)
    assert _deadlocks(mutant) == (not nx.is_directed_acyclic_graph(mutant.graph))
