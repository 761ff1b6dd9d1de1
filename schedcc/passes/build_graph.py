"""build_graph: the program as a networkx DAG, for analysis and drawing.

One node per instruction, `(stage, position)`, with attributes `instruction` and `version`.
Edges: program order on each stage (`kind="order"`), each matched send -> receive
(`kind="comm"`), and the data dependencies between computes (`kind="data"`): F(i, k) -> F(i, k+1),
B(i, k+1) -> B(i, k), F(i, k) -> B(i, k), I(i, k) -> W(i, k). `schedcc.compile` does not build it;
`Program.graph` builds it on first use, since a graph of 10^6 nodes costs seconds.
"""

from __future__ import annotations

import networkx as nx

from schedcc.analysis import Layout, match_comm
from schedcc.program import Program

__all__ = ["build_graph"]


def build_graph(program: Program) -> nx.DiGraph:
    """The dependency DAG of `program` (see the module docstring for nodes and edges)."""
    layout = Layout.of(program.schedule)
    graph = nx.DiGraph()
    where: dict[tuple, tuple[int, int]] = {}
    for s, ops in enumerate(program.stages):
        versions = program.versions[s] if program.versions else (None,) * len(ops)
        for pos, op in enumerate(ops):
            graph.add_node((s, pos), instruction=op, stage=s, version=versions[pos])
            if pos:
                graph.add_edge((s, pos - 1), (s, pos), kind="order")
            if op.group == "compute":
                where[op.code, op.microbatch, layout.segment[s][op.chunk]] = (s, pos)
    partner, _ = match_comm(program, layout)
    for s, ops in enumerate(program.stages):
        for pos, op in enumerate(ops):
            if op.group == "comm" and op.is_send and partner[s][pos] is not None:
                graph.add_edge((s, pos), partner[s][pos], kind="comm")
    for (code, i, k), node in where.items():
        before = []
        if code == "F":
            before.append(("F", i, k - 1))
        elif code in ("B", "I"):
            before += [("F", i, k), ("B", i, k + 1), ("I", i, k + 1)]
        elif code == "W":
            before.append(("I", i, k))
        for key in before:
            if key in where:
                graph.add_edge(where[key], node, kind="data")
    return graph
