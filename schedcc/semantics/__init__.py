"""The executable semantics of a program: the one rendezvous model everything else reads.

What a program means is written once, here, and the compiler passes, the validator, the
simulators and the backends all call it, so they agree by construction (docs/design.md,
"Semantics: the rendezvous model"):

- `layout`: where each segment lives (`Layout`);
- `tensors`: tensor identity, one int per tensor, and what each compute needs and makes and each
  comm op carries, on which channel (`Tensors`, `Route`, `comm_route`, `decode`);
- `channels`: sends paired with receives, FIFO per channel (`match_comm`);
- `units`: programs cut into units (a compute or update, or a comm group) and one walk of their
  events (`Units`, `walk`, `Walk`, `wait_for_cycle`, `critical_units`): deadlock freedom and
  timing;
- `versions`: the weight-version rule (`version_used`, `kept_versions`, `stashes`,
  `peak_live_versions`);
- `activations`: activation counting (`HELD`, `held_changes`, `peak_activations`, `first_over`,
  `held_bytes`);
- `stage_bytes`: the bytes a stage holds by kind under a `MemoryModel` (`stage_held`,
  `stage_peak`, `StageBytes`);
- `model`: those facts of one program, built for `Program`'s cached properties
  (`build_rendezvous_model`, read as `program.rendezvous_model`);
- `graph`: the program as a networkx DAG (`build_graph`, for `Program.graph`).
"""

from schedcc.semantics.activations import (
    HELD,
    first_over,
    held_bytes,
    held_changes,
    host_bytes,
    peak_activations,
    recomputed,
)
from schedcc.semantics.channels import CommProblem, match_comm
from schedcc.semantics.layout import Layout
from schedcc.semantics.model import (
    UNIT_COSTS,
    RendezvousModel,
    build_reference_walk,
    build_rendezvous_model,
    build_rule_versions,
    unit_durations,
)
from schedcc.semantics.stage_bytes import StageBytes, stage_held, stage_peak
from schedcc.semantics.tensors import (
    CommUse,
    ComputeUse,
    Route,
    TensorId,
    Tensors,
    comm_route,
    decode,
)
from schedcc.semantics.units import CopyLanes, Units, Walk, critical_units, wait_for_cycle, walk
from schedcc.semantics.versions import (
    kept_versions,
    peak_live_versions,
    stashes,
    version_used,
    versions_of,
)

__all__ = [
    "HELD",
    "UNIT_COSTS",
    "CommProblem",
    "CommUse",
    "ComputeUse",
    "CopyLanes",
    "Layout",
    "Route",
    "RendezvousModel",
    "StageBytes",
    "Units",
    "TensorId",
    "Tensors",
    "Walk",
    "build_reference_walk",
    "build_rendezvous_model",
    "build_rule_versions",
    "comm_route",
    "critical_units",
    "decode",
    "first_over",
    "held_bytes",
    "held_changes",
    "host_bytes",
    "kept_versions",
    "match_comm",
    "peak_activations",
    "peak_live_versions",
    "recomputed",
    "stage_held",
    "stage_peak",
    "stashes",
    "unit_durations",
    "version_used",
    "versions_of",
    "wait_for_cycle",
    "walk",
]
