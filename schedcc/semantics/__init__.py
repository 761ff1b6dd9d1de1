"""The executable semantics of a program: the one step model everything else reads.

What a program means is written once, here, and the compiler passes, the validator, the
simulators and the backends all call it, so they agree by construction (docs/design.md,
"Semantics: the step model"):

- `layout`: where each segment lives (`Layout`);
- `tensors`: tensor identity, one int per tensor, and what each compute needs and makes and each
  comm op carries, on which channel (`Tensors`, `Route`, `comm_route`, `decode`);
- `channels`: sends paired with receives, FIFO per channel (`match_comm`);
- `steps`: programs cut into steps and one walk of the step model's events (`Steps`, `walk`,
  `Walk`, `wait_for_cycle`): deadlock freedom and timing;
- `versions`: the weight-version rule (`version_used`, `kept_versions`, `stashes`);
- `memory`: activation counting (`HELD`, `held_changes`, `peak_activations`, `first_over`);
- `model`: those facts of one program, made once and kept with it (`step_model`);
- `graph`: the program as a networkx DAG (`build_graph`, for `Program.graph`).
"""

from schedcc.semantics.channels import CommProblem, match_comm
from schedcc.semantics.layout import Layout
from schedcc.semantics.memory import (
    HELD,
    first_over,
    held_bytes,
    held_changes,
    host_bytes,
    peak_activations,
    recomputed,
)
from schedcc.semantics.model import (
    STAGE_CACHES,
    UNIT_COSTS,
    StepModel,
    reference_walk,
    rule_versions,
    step_model,
    tensors_of,
    unit_durations,
)
from schedcc.semantics.steps import CopyLanes, Steps, Walk, wait_for_cycle, walk
from schedcc.semantics.tensors import (
    CommUse,
    ComputeUse,
    Route,
    TensorId,
    Tensors,
    comm_route,
    decode,
)
from schedcc.semantics.versions import kept_versions, stashes, version_used, versions_of

__all__ = [
    "HELD",
    "STAGE_CACHES",
    "UNIT_COSTS",
    "CommProblem",
    "CommUse",
    "ComputeUse",
    "CopyLanes",
    "Layout",
    "Route",
    "StepModel",
    "Steps",
    "TensorId",
    "Tensors",
    "Walk",
    "comm_route",
    "decode",
    "first_over",
    "held_bytes",
    "held_changes",
    "host_bytes",
    "kept_versions",
    "match_comm",
    "peak_activations",
    "recomputed",
    "reference_walk",
    "rule_versions",
    "stashes",
    "step_model",
    "tensors_of",
    "unit_durations",
    "version_used",
    "versions_of",
    "wait_for_cycle",
    "walk",
]
