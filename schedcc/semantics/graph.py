"""The program as a networkx DAG, for analysis and drawing (`Program.graph`).

One node per instruction, `(stage, position)`, with attributes `instruction`, `stage` and
`version`. Edges: program order on each stage (`kind="order"`), each matched send -> receive
(`kind="comm"`), and the data dependencies between computes (`kind="data"`), from the compute
that makes a tensor to each compute that needs it (see [Note: tensor keys]): F(i, k) -> F(i, k+1),
B(i, k+1) -> B(i, k), F(i, k) -> B(i, k), I(i, k) -> W(i, k). `schedcc.compile` does not build
it; `Program.graph` builds it on first use, since a graph of 10^6 nodes costs seconds.

[Note: waits in the graph] Two more kinds make the DAG the program's happens-before relation
under the rendezvous model (`schedcc.semantics.units`): an op that meets others finishes
only once they are *posted*, that is once the op before each one's step on its stage is done.
`kind="rendezvous"`: a send waits for its receive to be posted, an edge from the op before the
receive's comm group to the send. `kind="collective"`: the n-th `ReduceTied(g)` of a member
waits for every other member's n-th ([Note: tied collectives] in
`schedcc.semantics.collectives`), and the n-th `GradNorm` of a stage for every other stage's
([Note: the norm collective] in `schedcc.semantics.norms`): an edge from the op before each
other member to it. A collective first on its stage, or with one member, adds none; the
data-parallel collectives (`Reduce`, `Gather`, `Unshard`, `Reshard`) meet the same stage of the
other replicas, which run the same program, so they add none either. A wait-for cycle of the
validator's deadlock check is then a cycle of the graph, and a cycle of the graph is one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from schedcc.ir import Comm, Compute, GradNorm, ReduceTied
from schedcc.semantics.channels import match_comm
from schedcc.semantics.collectives import match_collectives
from schedcc.semantics.layout import Layout
from schedcc.semantics.norms import match_norms
from schedcc.semantics.units import Units

if TYPE_CHECKING:
    import networkx as nx

    from schedcc.program import Program

__all__ = ["build_graph"]


def build_graph(program: Program) -> nx.DiGraph:
    """The dependency DAG of `program` (see the module docstring for nodes and edges).

    >>> import schedcc
    >>> graph = build_graph(schedcc.compile(schedcc.get_schedule("gpipe")(2, 1)))
    >>> graph.number_of_nodes(), sorted({kind for *_, kind in graph.edges(data="kind")})
    (10, ['comm', 'data', 'order', 'rendezvous'])
    >>> tied = build_graph(schedcc.compile(schedcc.get_schedule("gpipe")(2, 1), tied=[(0, 1)]))
    >>> sorted((u, v) for u, v, kind in tied.edges(data="kind") if kind == "collective")
    [((0, 3), (1, 4)), ((1, 3), (0, 4))]
    """
    import networkx as nx

    tensors = program.tensors
    graph = nx.DiGraph()
    maker: dict[int, tuple[int, int]] = {}  # tensor key -> the node of the compute that makes it
    for s, ops in enumerate(program.stages):
        versions = program.versions[s] if program.versions else (None,) * len(ops)
        for pos, op in enumerate(ops):
            graph.add_node((s, pos), instruction=op, stage=s, version=versions[pos])
            if pos:
                graph.add_edge((s, pos - 1), (s, pos), kind="order")
            key = tensors.makes(s, op)
            if key is not None:
                maker.setdefault(key, (s, pos))
    partner, _ = match_comm(program.stages, tensors)
    units = Units.of(program.stages)
    for s, ops in enumerate(program.stages):
        for pos, op in enumerate(ops):
            if isinstance(op, Comm) and op.is_send and partner[s][pos] is not None:
                graph.add_edge((s, pos), partner[s][pos], kind="comm")
                before = _before(units, *partner[s][pos])
                if before is not None:
                    graph.add_edge(before, (s, pos), kind="rendezvous")
            elif isinstance(op, Compute):
                for key in tensors.needs(s, op):
                    if key in maker:
                        graph.add_edge(maker[key], (s, pos), kind="data")
    for meets in _collectives(program):
        for s, row in enumerate(meets):
            for pos, others in enumerate(row):
                for t, q in others or ():
                    before = _before(units, t, q)
                    if before is not None:
                        graph.add_edge(before, (s, pos), kind="collective")
    return graph


def _before(units: Units, s: int, pos: int) -> tuple[int, int] | None:
    """The op before the step that holds `(s, pos)`: done once that step is posted (None for
    a stage's first step, posted at the start)."""
    start = units.bounds[s][units.unit_at[s][pos]][0]
    return (s, start - 1) if start else None


def _collectives(program: Program):
    """The `meets` tables of the program's collectives: tied groups, then norms."""
    stages = program.stages
    has = {type(op) for ops in stages for op in ops}
    if ReduceTied in has and program.tied:
        yield match_collectives(stages, program.tied, Layout.of(program.schedule))[0]
    if GradNorm in has:
        yield match_norms(stages)[0]
