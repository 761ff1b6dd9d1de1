"""The compiler passes, one module each; `schedcc.compile` runs them in `PASSES` order.

Each pass is a pure function from `Program` to `Program` (collect starts from the schedule).
"""

from schedcc.passes.assign_versions import assign_versions
from schedcc.passes.collect import collect
from schedcc.passes.insert_comm import insert_comm
from schedcc.passes.insert_norm import insert_norm
from schedcc.passes.insert_offload import insert_offload
from schedcc.passes.insert_recompute import insert_recompute
from schedcc.passes.insert_sharding import insert_sharding
from schedcc.passes.insert_updates import insert_updates
from schedcc.semantics.graph import build_graph

__all__ = [
    "PASSES",
    "assign_versions",
    "build_graph",
    "collect",
    "insert_comm",
    "insert_norm",
    "insert_offload",
    "insert_recompute",
    "insert_sharding",
    "insert_updates",
]

#: The lowering passes after `collect` (and `insert_recompute`, which takes the recompute
#: policy), in order; `insert_offload`, which takes the offload policy, runs right after
#: `insert_comm`. `build_graph` (in `schedcc.semantics.graph`) runs when `Program.graph`
#: is read.
PASSES = (insert_comm, insert_updates, insert_sharding, insert_norm, assign_versions)
