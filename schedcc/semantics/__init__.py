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
- `model`: those facts of one program, built for `Program`'s cached properties
  (`build_step_model`, read as `program.step_model`);
- `graph`: the program as a networkx DAG (`build_graph`, for `Program.graph`).
"""

from schedcc.semantics.channels import CommProblem, match_comm
from schedcc.semantics.layout import Layout
from schedcc.semantics.memory import (
    HELD,
    first_over,
    held_bytes,
    held_changes,
    peak_activations,
    recomputed,
)
from schedcc.semantics.model import (
    UNIT_COSTS,
    StepModel,
    build_reference_walk,
    build_rule_versions,
    build_step_model,
    unit_durations,
)
from schedcc.semantics.steps import Steps, Walk, wait_for_cycle, walk
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
    "UNIT_COSTS",
    "CommProblem",
    "CommUse",
    "ComputeUse",
    "Layout",
    "Route",
    "StepModel",
    "Steps",
    "TensorId",
    "Tensors",
    "Walk",
    "build_reference_walk",
    "build_rule_versions",
    "build_step_model",
    "comm_route",
    "decode",
    "first_over",
    "held_bytes",
    "held_changes",
    "kept_versions",
    "match_comm",
    "peak_activations",
    "recomputed",
    "stashes",
    "unit_durations",
    "version_used",
    "versions_of",
    "wait_for_cycle",
    "walk",
]
