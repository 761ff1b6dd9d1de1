"""The program as a networkx DAG, for analysis and drawing (`Program.graph`).

One node per instruction, `(stage, position)`, with attributes `instruction`, `stage` and
`version`. Edges: program order on each stage (`kind="order"`), each matched send -> receive
(`kind="comm"`), and the data dependencies between computes (`kind="data"`), from the compute
that makes a tensor to each compute that needs it (see [Note: tensor keys]): F(i, k) -> F(i, k+1),
B(i, k+1) -> B(i, k), F(i, k) -> B(i, k), I(i, k) -> W(i, k). `schedcc.compile` does not build
it; `Program.graph` builds it on first use, since a graph of 10^6 nodes costs seconds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from schedcc.ir import Comm, Compute
from schedcc.semantics.channels import match_comm
from schedcc.semantics.tensors import Tensors

if TYPE_CHECKING:
    import networkx as nx

    from schedcc.program import Program

__all__ = ["build_graph"]


def build_graph(program: Program) -> nx.DiGraph:
    """The dependency DAG of `program` (see the module docstring for nodes and edges).

    >>> import schedcc
    >>> graph = build_graph(schedcc.compile(schedcc.get_schedule("gpipe")(2, 1)))
    >>> graph.number_of_nodes(), sorted({kind for *_, kind in graph.edges(data="kind")})
    (10, ['comm', 'data', 'order'])
    """
    import networkx as nx

    tensors = Tensors.of(program.schedule)
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
    for s, ops in enumerate(program.stages):
        for pos, op in enumerate(ops):
            if isinstance(op, Comm) and op.is_send and partner[s][pos] is not None:
                graph.add_edge((s, pos), partner[s][pos], kind="comm")
            elif isinstance(op, Compute):
                for key in tensors.needs(s, op):
                    if key in maker:
                        graph.add_edge(maker[key], (s, pos), kind="data")
    return graph
